"""JSON schemas of tool parameters from Python signatures and docstrings (shared by ``@tool`` functions and
:class:`~agentrl.envs.tools.base.StatefulTool` ``run`` methods)."""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable
from typing import Any, get_type_hints

from pydantic import TypeAdapter

_ARG_LINE = re.compile(r"^\s{2,}(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


_SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns?|Raises|Yields|Examples?|Notes?):\s*$")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """Split a docstring into (description, {param: description}) using a Google-style ``Args:`` section.

    The description is the text before the first section header; parameter descriptions may continue on
    more-indented lines."""
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    heads = [k for k, line in enumerate(lines) if _SECTION.match(line.strip()) and not line.startswith(" ")]
    desc = "\n".join(lines[: heads[0]] if heads else lines).strip()
    params: dict[str, str] = {}
    args_at = next(
        (k for k in heads if lines[k].strip().rstrip(":") in ("Args", "Arguments", "Parameters")), None
    )
    if args_at is None:
        return desc, params
    current: str | None = None
    for line in lines[args_at + 1 :]:
        if line.strip() and not line.startswith(" "):
            break  # the next section
        m = _ARG_LINE.match(line)
        if m and len(line) - len(line.lstrip()) <= 4:
            current = m.group(1).lstrip("*")
            params[current] = m.group(2).strip()
        elif current and line.strip():
            params[current] = f"{params[current]} {line.strip()}".strip()
    return desc, params


def schema_from_signature(fn: Callable[..., Any], param_docs: dict[str, str], *, skip: int = 0) -> dict[str, Any]:
    """JSON schema (type ``object``) of ``fn``'s parameters from its type hints; unannotated = any type.
    ``skip``: leading parameters that are not tool arguments (``self, session`` of a ``run`` method)."""
    sig = inspect.signature(fn)
    hints = get_type_hints(fn, include_extras=True)
    properties: dict[str, Any] = {}
    required: list[str] = []
    defs: dict[str, Any] = {}
    for pname, p in list(sig.parameters.items())[skip:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"a tool cannot describe *args/**kwargs (parameter {pname!r} of {fn.__qualname__})")
        if pname in hints:
            schema = TypeAdapter(hints[pname]).json_schema(ref_template="#/$defs/{model}")
            defs.update(schema.pop("$defs", {}))
        else:
            schema = {}
        schema.pop("title", None)
        if pname in param_docs:
            schema["description"] = param_docs[pname]
        if p.default is inspect.Parameter.empty:
            required.append(pname)
        else:
            try:
                json.dumps(p.default)
                schema["default"] = p.default
            except TypeError:
                pass
        properties[pname] = schema
    out: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        out["required"] = required
    if defs:
        out["$defs"] = defs
    return out

