"""Check constructor arguments for an env class before anything expensive runs (a model load, a sandbox pool).

``env_kwargs.foo=1`` or ``env.max_turns=abc`` on a command line used to surface only when the env was built,
after the model had loaded. :func:`check_env_kwargs` reads what the env class accepts from its constructors'
signatures (the class's own ``__init__`` and, through ``**kwargs``, its bases' up to :class:`AgentEnv`, whose
``**limit_overrides`` are the :class:`EnvLimits` fields) and checks names and types at once.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from collections.abc import Mapping
from typing import Any

from agentrl.envs.env import AgentEnv, EnvLimits


class EnvKwargsError(ValueError):
    """A constructor argument the env does not take, or of the wrong type; the message says which and what
    the env takes."""


@dataclasses.dataclass(frozen=True)
class EnvParameter:
    """One argument an env constructor takes: its annotation (``Any`` when none or unresolvable) and default
    (``inspect.Parameter.empty`` when required)."""

    name: str
    annotation: Any
    default: Any


def env_parameters(cls: type) -> dict[str, EnvParameter]:
    """Every keyword argument ``cls(...)`` accepts, by name. A constructor with ``**kwargs`` is taken to pass
    them on to its base class's; :class:`AgentEnv`'s ``**limit_overrides`` are the :class:`EnvLimits` fields."""
    params: dict[str, EnvParameter] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        if klass is object:
            break
        hints = _hints(init)
        forwards = False
        for i, (name, p) in enumerate(inspect.signature(init).parameters.items()):
            if i == 0 or p.kind is p.VAR_POSITIONAL:
                continue
            if p.kind is p.VAR_KEYWORD:
                forwards = True
            elif name not in params:
                params[name] = EnvParameter(name, hints.get(name, Any), p.default)
        if klass is AgentEnv:
            limit_hints = typing.get_type_hints(EnvLimits)
            for field in dataclasses.fields(EnvLimits):
                params.setdefault(field.name, EnvParameter(field.name, limit_hints[field.name], field.default))
            break
        if not forwards:
            break
    return params


def check_env_kwargs(cls: type, kwargs: Mapping[str, Any], *, prefix: str = "env_kwargs.") -> None:
    """Raise :class:`EnvKwargsError` unless every ``kwargs`` entry is an argument ``cls`` takes, with a value
    of its annotated type (checked by pydantic in lax mode: ``3`` passes for a ``float``, ``"abc"`` fails
    for an ``int``; annotations pydantic cannot check are not checked). ``prefix``: how the command line
    spells these keys (``env_kwargs.`` for train, ``env.`` for eval), used in the message."""
    params = env_parameters(cls)
    for key, value in kwargs.items():
        if key not in params:
            from agentrl.cli_args import suggest  # here: importing the env SDK reads no config library

            hint = suggest(key, params, n=2, cutoff=0.6, show=lambda c: prefix + c)
            raise EnvKwargsError(
                f"{prefix}{key}: {cls.__name__} takes no argument {key!r}.{hint} It takes: {', '.join(sorted(params))}"
            )
        problem = _type_problem(params[key].annotation, value)
        if problem:
            raise EnvKwargsError(f"{prefix}{key}={value!r} is not valid for {cls.__name__}: {problem}")


def _hints(fn: Any) -> dict[str, Any]:
    """The resolvable type hints of ``fn``, one by one (a hint naming a type imported only for type checking
    is skipped, not fatal)."""
    try:
        return typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - fall back to resolving each annotation alone
        pass
    out: dict[str, Any] = {}
    namespace = getattr(fn, "__globals__", {})
    for name, annotation in getattr(fn, "__annotations__", {}).items():
        try:
            out[name] = eval(annotation, namespace) if isinstance(annotation, str) else annotation  # noqa: S307
        except Exception:  # noqa: BLE001 - unresolvable: unchecked
            continue
    return out


def _type_problem(annotation: Any, value: Any) -> str | None:
    """Why ``value`` does not fit ``annotation`` (the first pydantic error, and the expected type), or None."""
    if annotation is Any:
        return None
    from pydantic import ConfigDict, TypeAdapter, ValidationError

    try:
        adapter = TypeAdapter(annotation, config=ConfigDict(arbitrary_types_allowed=True))
    except Exception:  # noqa: BLE001 - a type pydantic cannot describe is not checked
        try:
            adapter = TypeAdapter(annotation)
        except Exception:  # noqa: BLE001
            return None
    try:
        adapter.validate_python(value)
    except ValidationError as exc:
        first = exc.errors()[0]["msg"]
        return f"expected {_type_name(annotation)} ({first})"
    except Exception:  # noqa: BLE001 - e.g. isinstance against a non-runtime protocol: not checked
        return None
    return None


def _type_name(annotation: Any) -> str:
    """``int``, ``SandboxBackend | str``: the annotation without module paths."""
    return getattr(annotation, "__name__", None) or re.sub(r"\b(?:\w+\.)+(\w+)", r"\1", str(annotation))
