"""``@tool``: turn a typed Python function (sync or async) into a :class:`~agentrl.envs.tools.base.Tool`.

The JSON schema comes from the type hints (via pydantic, so ``Literal``, ``Optional``, ``list[int]``,
``TypedDict`` and pydantic models all work) and the docstring (first paragraph = description; a Google-style
``Args:`` section = parameter descriptions). Parameters without a default are required.

Example::

    @tool
    def add(a: int, b: int = 0) -> int:
        \"\"\"Add two integers.

        Args:
            a: first addend
            b: second addend
        \"\"\"
        return a + b
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections.abc import Callable
from typing import Any, get_type_hints

from pydantic import TypeAdapter

from agentrl.envs.tools.base import Tool, ToolOutput

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


def schema_from_signature(fn: Callable[..., Any], param_docs: dict[str, str]) -> dict[str, Any]:
    """JSON schema (type ``object``) of ``fn``'s parameters from its type hints; unannotated = any type."""
    sig = inspect.signature(fn)
    hints = get_type_hints(fn, include_extras=True)
    properties: dict[str, Any] = {}
    required: list[str] = []
    defs: dict[str, Any] = {}
    for pname, p in sig.parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"@tool cannot describe *args/**kwargs (parameter {pname!r} of {fn.__name__})")
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


class FunctionTool(Tool):
    """A tool backed by a plain function. Sync functions run in a worker thread (so a per-call timeout can
    fire and the event loop keeps serving other episodes) unless ``inline=True``. Non-string return values
    are rendered as JSON."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        timeout_s: float | None = None,
        inline: bool = False,
    ) -> None:
        doc_desc, param_docs = parse_docstring(fn.__doc__)
        self.fn = fn
        self.name = name or fn.__name__
        self.description = description if description is not None else doc_desc
        self.parameters = schema_from_signature(fn, param_docs)
        self.timeout_s = timeout_s
        self.inline = inline
        self._is_async = inspect.iscoroutinefunction(fn)

    async def call(self, arguments: dict[str, Any], session: Any = None) -> str | ToolOutput:
        if self._is_async:
            value = await self.fn(**arguments)
        elif self.inline:
            value = self.fn(**arguments)
        else:
            value = await asyncio.to_thread(self.fn, **arguments)
        if isinstance(value, (str, ToolOutput)):
            return value
        return json.dumps(value, ensure_ascii=False, default=str)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped function directly (handy in tests and scripts)."""
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"FunctionTool({self.name!r})"


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float | None = None,
    inline: bool = False,
) -> Any:
    """Decorator: ``@tool`` or ``@tool(name=..., timeout_s=..., inline=...)`` -> :class:`FunctionTool`."""

    def wrap(f: Callable[..., Any]) -> FunctionTool:
        return FunctionTool(f, name=name, description=description, timeout_s=timeout_s, inline=inline)

    return wrap(fn) if fn is not None else wrap
