"""One command-line convention for every ``agentrl`` command: ``key=value`` arguments checked against a
dataclass schema through OmegaConf.

A command declares each of its keys once, as a dataclass field made by :func:`key`: type (the annotation),
default, a one-line description, valid values and bounds, plus whatever else the command reads from the
declaration (the trainer's per-device defaults, its verl mapping). Its :class:`CommandSpec` names the schema,
aliases, which key bare words fill and the cross-field check; :func:`run` handles ``--help`` (every key with its
default, valid values and description), parses, validates once, and turns every user mistake into one line on
stderr and exit status 2:

- keys are dotted (``actor.lr=1e-5``); a field typed as a dict takes any sub-key (``env_kwargs.limit=3``);
  values are OmegaConf values (``k=[1,2]``, ``x=null``); ``--key value``, ``--key=value`` and a bare
  ``--flag`` (for a bool) are accepted too, with dashes read as underscores;
- an unknown key, an unknown value of an enum key or an unknown command names close matches
  (``difflib``), else says where the full list is (``--help``); a value out of its bounds names them;
- a value of the wrong type names its key, the expected type and an example (the default);
- a required key that is missing says so, with an example.

This module imports no torch, so ``--help`` and argument errors are instant for commands that keep
their schema torch-free.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

HELP_FLAGS = ("-h", "--help", "help")

#: enum key -> its valid values, or a callable returning them (looked up only when the key is checked)
Choices = Mapping[str, Sequence[str] | Callable[[], Sequence[str]]]


class UsageError(ValueError):
    """A mistake on the command line; the message is one line that says what was wrong and what to do."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C's KeyboardInterrupt is (``agentrl``'s entry point installs the
    handler), so a run stops the same way and says so (exit status 143)."""


def raise_terminated(signum: int, frame: Any) -> None:
    """A SIGTERM handler: raise :class:`Terminated`."""
    raise Terminated()


def interrupted(exc: KeyboardInterrupt) -> tuple[str, int]:
    """How a command was stopped, in words, and its exit status: SIGTERM (143) or an interrupt (130)."""
    return ("terminated (SIGTERM)", 143) if isinstance(exc, Terminated) else ("interrupted", 130)


def plain_text(doc: str) -> str:
    """A docstring's reST/Sphinx markup as plain text for ``--help``: ````x```` is ``x``, ``:class:`~a.b.C``` is
    ``C``, ``:func:`text <a.b>``` is ``text``, ``:mod:`a.b``` is ``a.b``."""
    import re

    def role(m: re.Match[str]) -> str:
        target = m.group(1)
        if "<" in target and target.endswith(">"):
            return target.split("<", 1)[0].strip()
        return target.rsplit(".", 1)[-1] if target.startswith("~") else target

    text = re.sub(r":[a-z]+(?::[a-z]+)?:`([^`]+)`", role, doc)
    return re.sub(r"``([^`]+)``", r"\1", text)


def suggest(word: str, options: Iterable[Any], *, fallback: str = "", cutoff: float = 0.5, n: int = 3,
            show: Callable[[str], str] = str) -> str:
    """``" Did you mean: a, b?"`` with the (at most ``n``) close matches of ``word`` in ``options``, each written
    by ``show``, else ``fallback``: the one way every command and error message suggests a name."""
    close = difflib.get_close_matches(str(word), [str(o) for o in options], n=n, cutoff=cutoff)
    return f" Did you mean: {', '.join(show(c) for c in close)}?" if close else fallback


def is_help(argv: Sequence[str]) -> bool:
    return any(a in HELP_FLAGS for a in argv)


# ---------------------------------------------------------------- declaring keys
_NO_DEFAULT: Any = dataclasses.MISSING


def key(
    default: Any = _NO_DEFAULT,
    doc: str = "",
    *,
    choices: Sequence[Any] | Callable[[], Sequence[Any]] | None = None,
    min: float | None = None,  # noqa: A002 - the bound's natural name
    gt: float | None = None,
    max: float | None = None,  # noqa: A002
    check: Callable[[Any], Any] | None = None,
    **extra: Any,
) -> Any:
    """Declare one config key as a dataclass field: its ``default`` (lists and dicts are copied per instance;
    omit it, or pass ``omegaconf.MISSING``, for a required key), a one-line ``doc`` (shown by ``--help``),
    ``choices`` (its valid values, or a function returning them, e.g. the registered env names; for a list
    key, the valid values of its items), bounds (``min`` <= value, ``gt`` < value, value <= ``max``) and
    ``check``, a function of a set value that raises ``ValueError`` (or ``TypeError``) saying why it is not
    valid (for values a type cannot say, e.g. a number or a ``'lo_hi'`` string), all checked by :func:`parse`.
    Every number of every key, a list's items included, must be finite: inf and NaN are refused whatever
    the declaration. ``extra`` entries are kept for the command's own use (:func:`declaration`), e.g. the
    trainer's ``gpu=`` default and ``verl=`` key."""
    meta = {"doc": doc, "choices": choices, "min": min, "gt": gt, "max": max, "check": check, **extra}
    if isinstance(default, (list, dict)):
        value = default
        return field(default_factory=lambda: type(value)(value), metadata=meta)
    return field(default=default, metadata=meta)


def declaration(schema: type, dotted: str) -> Mapping[str, Any]:
    """What :func:`key` declared for dotted key ``dotted`` of ``schema`` (empty for a plain field)."""
    node: Any = schema
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(node):
            return {}
        fields = {f.name: f for f in dataclasses.fields(node)}
        if part not in fields:
            return {}
        if i == len(parts) - 1:
            return fields[part].metadata
        tp = _strip_optional(_hints(node).get(part, fields[part].type))
        node = tp if dataclasses.is_dataclass(tp) else type(_default(fields[part]))
    return {}


def declarations(schema: type) -> dict[str, Mapping[str, Any]]:
    """Every leaf key of ``schema`` with its declaration, in declaration order."""
    return {k: declaration(schema, k) for k in schema_keys(schema)}


# ---------------------------------------------------------------- schema introspection


def _hints(schema: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(schema)
    except (NameError, TypeError):  # an annotation that cannot be resolved: fall back to the raw ones
        return {f.name: f.type for f in dataclasses.fields(schema)}


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _strip_optional(tp: Any) -> Any:
    args = typing.get_args(tp)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0] if len(rest) == 1 else tp
    return tp


def _is_dict(tp: Any) -> bool:
    tp = _strip_optional(tp)
    return tp is dict or typing.get_origin(tp) is dict


def schema_keys(schema: type, prefix: str = "") -> list[str]:
    """Every dotted leaf key of a dataclass schema (nested dataclasses flattened), in declaration order."""
    keys: list[str] = []
    hints = _hints(schema)
    for f in dataclasses.fields(schema):
        tp = _strip_optional(hints.get(f.name, f.type))
        if dataclasses.is_dataclass(tp) or dataclasses.is_dataclass(_default(f)):
            sub = tp if dataclasses.is_dataclass(tp) else type(_default(f))
            keys += schema_keys(sub, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def field_type(schema: type, key: str) -> Any:
    """The annotation of dotted ``key`` in ``schema`` (``None`` if it is not a field)."""
    node: Any = schema
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(node):
            return None
        fields = {f.name: f for f in dataclasses.fields(node)}
        if part not in fields:
            return None
        tp = _strip_optional(_hints(node).get(part, fields[part].type))
        if i == len(parts) - 1:
            return tp
        node = tp if dataclasses.is_dataclass(tp) else type(_default(fields[part]))
    return None


def _open_prefixes(schema: type) -> list[str]:
    """Keys of dict-typed fields: any sub-key under them is accepted."""
    return [k for k in schema_keys(schema) if _is_dict(field_type(schema, k))]


def _type_label(tp: Any) -> str:
    tp = _strip_optional(tp)
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    origin = typing.get_origin(tp)
    if origin in (list, tuple) or tp in (list, tuple):
        inner = typing.get_args(tp)
        return f"a list like [a,b]{f' of {_type_label(inner[0])}s' if inner else ''}"
    if _is_dict(tp):
        return "a mapping like {a: 1}"
    return getattr(tp, "__name__", str(tp))


# ---------------------------------------------------------------- the spec


@dataclass(frozen=True)
class CommandSpec:
    """How one command reads its arguments.

    ``schema``: the dataclass whose fields are the keys. ``choices``: enum keys and their valid values.
    ``aliases``: extra key names (``{"k": "ks"}``) and key prefixes ending in ``.`` (``{"env.": "env_kwargs."}``).
    ``positional``: the key that bare words (arguments without ``=``) fill; a list key takes several.
    ``examples``: an example value per required key, shown when it is missing. ``value_filters``:
    per-key rewrites of the raw text before OmegaConf reads it (``"1,2,4"`` -> ``"[1,2,4]"``).
    ``check``: the cross-field rules, run once after every key's own declaration was checked; raises
    :class:`UsageError`. ``usage``/``notes``: the first and the last lines of ``--help``. Valid values
    belong in each key's declaration (:func:`key`); ``choices`` adds them for schemas with plain fields.
    """

    prog: str
    schema: type
    usage: str
    choices: Choices = field(default_factory=dict)
    aliases: Mapping[str, str] = field(default_factory=dict)
    positional: str | None = None
    examples: Mapping[str, str] = field(default_factory=dict)
    value_filters: Mapping[str, Callable[[str], str]] = field(default_factory=dict)
    check: Callable[[DictConfig], None] | None = None
    notes: str = ""

    def keys(self) -> list[str]:
        return schema_keys(self.schema)



    def help_hint(self) -> str:
        return f" Run `{self.prog} --help` for every key."



def _canonical_key(spec: CommandSpec, key: str) -> str:
    key = key.strip().lstrip("+~").replace("-", "_")
    if key in spec.aliases:
        return spec.aliases[key]
    for alias, target in spec.aliases.items():
        if alias.endswith(".") and key.startswith(alias):
            return target + key[len(alias) :]
    return key


def check_key(spec: CommandSpec, key: str) -> None:
    """Raise :class:`UsageError` (with close matches) unless ``key`` is a key of ``spec``."""
    keys = spec.keys()
    if key in keys or any(k.startswith(key + ".") for k in keys):
        return
    if any(key.startswith(p + ".") for p in _open_prefixes(spec.schema)):
        return
    shown = keys + [a for a in spec.aliases if not a.endswith(".")]
    raise UsageError(f"unknown key {key!r}.{suggest(key, shown, fallback='')}{spec.help_hint()}")


def _normalise(spec: CommandSpec, argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split ``argv`` into ``key=value`` overrides (canonical keys) and bare words."""
    overrides: list[str] = []
    bare: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg.startswith("--") and len(arg) > 2:
            name, sep, value = arg[2:].partition("=")
            key = _canonical_key(spec, name)
            if not sep:
                is_bool = field_type(spec.schema, key) is bool
                if is_bool and (i >= len(args) or args[i].lower() not in ("true", "false", "1", "0")):
                    value = "true"
                elif i < len(args):
                    value, i = args[i], i + 1
                else:
                    check_key(spec, key)
                    raise UsageError(f"--{name} needs a value, e.g. --{name} VALUE or {key}=VALUE")
            overrides.append(f"{key}={value}")
        elif "=" in arg and not arg.startswith("="):
            name, _, value = arg.partition("=")
            overrides.append(f"{_canonical_key(spec, name)}={value}")
        else:
            bare.append(arg)
    return overrides, bare


def normalise(spec: CommandSpec, argv: Sequence[str]) -> list[str]:
    """``argv``'s ``key=value`` overrides with canonical keys (``--key value`` and aliases resolved)."""
    return _normalise(spec, argv)[0]


def split_args(spec: CommandSpec, argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(overrides, bare words)`` of ``argv``: the ``key=value`` overrides with canonical keys (``--key value``,
    ``--key=value`` and aliases resolved, in order) and the arguments without ``=``."""
    return _normalise(spec, argv)


def value_of(spec: CommandSpec, argv: Sequence[str], name: str) -> str | None:
    """The raw text ``argv`` gives key ``name`` (the last one wins, whichever spelling), or None."""
    found = None
    for token in normalise(spec, argv):
        key, _, value = token.partition("=")
        if key == name:
            found = value
    return found


def _bare_error(spec: CommandSpec, word: str) -> UsageError:
    if word.startswith("-"):
        return UsageError(f"unknown option {word!r}; arguments are key=value.{spec.help_hint()}")
    hint = suggest(word.replace("-", "_"), spec.keys(), n=1, cutoff=0.6, show=lambda k: f"{k}=...",
                   fallback=f" e.g. {spec.usage.split(' ', 2)[-1]}")
    return UsageError(f"expected key=value, got {word!r}.{hint}")


def _value_error(spec: CommandSpec, key: str, value: str, detail: str = "") -> UsageError:
    tp = field_type(spec.schema, key)
    defaults = OmegaConf.structured(spec.schema)
    example = None
    try:
        example = OmegaConf.select(defaults, key, throw_on_missing=False)
    except OmegaConfBaseException:
        pass
    if OmegaConf.is_config(example):
        example = OmegaConf.to_container(example)
    expected = f" expected {_type_label(tp)}" if tp is not None else f" {detail}"
    if example is None:
        example = _EXAMPLES.get(_strip_optional(tp))
    eg = f"; e.g. {key}={show_value(example)}" if example is not None else ""
    return UsageError(f"bad value {key}={value!r}:{expected}{eg}")


#: example values by type, for keys whose default is null
_EXAMPLES: dict[Any, Any] = {int: 8, float: 0.5, bool: True, str: "TEXT"}


def show_value(value: Any) -> str:
    """``value`` as it is written on a command line: ``true``, ``null``, ``[a,b]``."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(show_value(v) for v in value) + "]"
    if value is None:
        return "null"
    return str(value)


def parse(
    spec: CommandSpec, argv: Sequence[str], *, base: DictConfig | None = None, base_name: str = "the saved config"
) -> DictConfig:
    """The schema's defaults (or ``base`` merged over them; ``base_name`` names it in errors, e.g. its file) with
    ``argv`` applied; raises :class:`UsageError`.

    Checks keys, types, enum values and required keys; cross-field rules stay with the command."""
    overrides, bare = _normalise(spec, argv)
    if bare:
        if spec.positional is None:
            raise _bare_error(spec, bare[0])
        if field_type(spec.schema, spec.positional) is str:
            if len(bare) > 1:
                raise _bare_error(spec, bare[1])
            overrides.append(f"{spec.positional}={_quote(bare[0])}")
        else:
            overrides.append(f"{spec.positional}=[{','.join(_quote(b) for b in bare)}]")
    raw: dict[str, str] = {}
    for token in overrides:
        key, _, value = token.partition("=")
        check_key(spec, key)
        if key in spec.value_filters:
            value = spec.value_filters[key](value)
        raw[key] = value
    dotlist = [f"{k}={v}" for k, v in raw.items()]
    schema = OmegaConf.structured(spec.schema)
    try:
        cfg = OmegaConf.merge(schema, base) if base is not None else schema
    except OmegaConfBaseException as exc:
        where = f" at {exc.full_key}" if getattr(exc, "full_key", None) else ""
        raise UsageError(f"{base_name} does not fit this version{where}: {str(exc).splitlines()[0]}; the file is "
                         "damaged or written by another agentrl version: fix that key or start a new run") from None
    for item in dotlist:  # one at a time, so an error names the exact key and value
        key, _, value = item.partition("=")
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))
        except (ValidationError, ConfigKeyError) as exc:
            raise _value_error(spec, key, value, str(exc).splitlines()[0]) from None
        except OmegaConfBaseException as exc:
            raise UsageError(f"bad value {key}={value!r}: {str(exc).splitlines()[0]}") from None
    for key in spec.keys():
        if OmegaConf.is_missing(cfg, key):
            eg = spec.examples.get(key)
            raise UsageError(f"{key} is required, e.g. {spec.prog} {eg or key + '=...'}")
    check_values(spec, cfg)
    if spec.check is not None:
        spec.check(cfg)
    return cfg


def check_values(spec: CommandSpec, cfg: DictConfig) -> None:
    """Check every key against its declaration (valid values, bounds); raises :class:`UsageError` naming the
    key, what is valid and the close matches. ``None`` (an optional key left unset) always passes."""
    for key in spec.keys():
        value = OmegaConf.select(cfg, key)
        extra = spec.choices.get(key)
        _check_value(key, OmegaConf.to_container(value) if OmegaConf.is_config(value) else value,
                     declaration(spec.schema, key), extra() if callable(extra) else extra)


def check_declared(obj: Any) -> None:
    """Check a dataclass instance's fields against their :func:`key` declarations (for objects built in Python
    rather than parsed); raises :class:`UsageError` like :func:`parse`."""
    for f in dataclasses.fields(obj):
        _check_value(f.name, getattr(obj, f.name), f.metadata)


def _check_value(key: str, value: Any, meta: Mapping[str, Any], extra: Sequence[Any] | None = None) -> None:
    if value is None:
        return
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(item, float) and not math.isfinite(item):
            raise UsageError(f"{key} must be a finite number, got {show_value(value)}")
    if meta.get("check") is not None:
        try:
            meta["check"](value)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"bad value {key}={show_value(value)}: {str(exc).splitlines()[0]}") from None
    valid = meta.get("choices") or extra
    accept = meta.get("accept")  # values valid beyond the choices (e.g. an env given as module:Class)
    if valid is not None and not (accept is not None and isinstance(value, str) and accept(value)):
        valid = list(valid() if callable(valid) else valid)
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if item not in valid and str(item) not in [str(v) for v in valid]:
                shown = [str(v) for v in valid]
                raise UsageError(f"{key}={item!r} is not valid.{suggest(str(item), shown)} Valid: {', '.join(shown)}")
    low, above, high = meta.get("min"), meta.get("gt"), meta.get("max")
    # written as "not within" so that NaN, which compares false with everything, fails any bound
    if (low is not None and not value >= low) or (above is not None and not value > above) or (
        high is not None and not value <= high
    ):
        raise UsageError(f"{key} must be {_bounds(meta)}, got {value!r}")


def _bounds(meta: Mapping[str, Any]) -> str:
    """``>= 1``, ``> 0 and <= 1``: a declaration's bounds in words."""
    parts = [f"{op} {meta[name]:g}" for name, op in (("min", ">="), ("gt", ">"), ("max", "<=")) if meta.get(name) is not None]
    return " and ".join(parts)


def _quote(word: str) -> str:
    """A bare word as an OmegaConf value that stays a string (paths with ``:`` or ``,``)."""
    return "'" + word.replace("\\", "\\\\").replace("'", "\\'") + "'"


def to_object(spec: CommandSpec, cfg: DictConfig) -> Any:
    """``cfg`` as an instance of the schema; a ``ValueError`` from its ``__post_init__`` becomes a
    :class:`UsageError`."""
    try:
        return OmegaConf.to_object(cfg)
    except ValueError as exc:
        raise UsageError(str(exc).splitlines()[0]) from None
    except OmegaConfBaseException as exc:
        cause = exc.__cause__ if isinstance(exc.__cause__, ValueError) else exc
        raise UsageError(str(cause).splitlines()[0]) from None


def field_docs(schema: type, prefix: str = "") -> dict[str, str]:
    """Dotted key -> the first paragraph, on one line, of the string literal written under the field (an attribute
    docstring), for the dataclasses that document their fields that way; nested dataclasses included."""
    import ast
    import inspect
    import textwrap

    docs: dict[str, str] = {}
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(schema)))
    except (OSError, TypeError, SyntaxError):
        return docs
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[prefix + node.target.id] = " ".join(after.value.value.strip().split("\n\n")[0].split())
    hints = _hints(schema)
    for f in dataclasses.fields(schema):
        tp = _strip_optional(hints.get(f.name, f.type))
        if dataclasses.is_dataclass(tp):
            docs.update(field_docs(tp, f"{prefix}{f.name}."))
    return docs


class KeyRow(typing.NamedTuple):
    """One key as ``--help`` and ``docs/config.md`` show it: dotted ``key``, its default as written on a command
    line (``(required)`` when it has none), its valid values or bounds (``""`` when any value of its type goes)
    and its one-line description (``""`` when undocumented)."""

    key: str
    default: str
    valid: str
    doc: str


def key_rows(
    spec: CommandSpec, *, docs: Mapping[str, str] | None = None, defaults: DictConfig | None = None,
) -> list[KeyRow]:
    """Every key of ``spec`` in declaration order, with its default (from ``defaults``, a command's own profile,
    else the schema's declared defaults), valid values (the declaration's ``choices`` unless they are computed,
    else ``spec.choices``, else its bounds) and description (``docs``, else the key's declaration, else the
    field's attribute docstring)."""
    defaults = OmegaConf.structured(spec.schema) if defaults is None else defaults
    declared = {k: m["doc"] for k, m in declarations(spec.schema).items() if m.get("doc")}
    docs = {**field_docs(spec.schema), **declared, **(docs or {})}
    rows = []
    for key in spec.keys():
        if OmegaConf.is_missing(defaults, key):
            shown = "(required)"
        else:
            value = OmegaConf.select(defaults, key)
            shown = show_value(OmegaConf.to_container(value) if OmegaConf.is_config(value) else value)
        valid = ""
        raw = declaration(spec.schema, key).get("choices") or spec.choices.get(key)
        if raw is not None and not callable(raw):
            valid = ", ".join(str(v) for v in raw)
        elif _bounds(declaration(spec.schema, key)):
            valid = _bounds(declaration(spec.schema, key))
        rows.append(KeyRow(key, shown, valid, docs.get(key, "")))
    return rows


def help_text(
    spec: CommandSpec, *, docs: Mapping[str, str] | None = None, defaults: DictConfig | None = None,
) -> str:
    """``usage``, then every key of :func:`key_rows` (``docs``, ``defaults``: as there) on one line each, then the
    aliases and ``notes``."""
    lines = [f"usage: {spec.usage}", "", "keys (key=value; dotted keys nest; lists as key=[a,b]):"]
    for row in key_rows(spec, docs=docs, defaults=defaults):
        valid = f"  [{row.valid}]" if row.valid else ""
        doc = f"  # {row.doc}" if row.doc else ""
        lines.append(f"  {row.key} = {row.default}{valid}{doc}")
    aliases = [f"{a} -> {t}" for a, t in spec.aliases.items()]
    if aliases:
        lines.append(f"aliases: {', '.join(aliases)}")
    if spec.notes:
        lines += ["", spec.notes.strip()]
    return "\n".join(lines)


def fail(prog: str, message: str) -> int:
    """Print ``prog: message`` (first line only) to stderr; returns exit status 2."""
    print(f"{prog}: {message.strip().splitlines()[0] if message.strip() else 'error'}", file=sys.stderr)
    return 2


def run(
    spec: CommandSpec,
    argv: Sequence[str] | None,
    body: Callable[[DictConfig], int | None],
    *,
    help: Callable[[], str] | None = None,  # noqa: A002 - mirrors the flag
    prepare: Callable[[list[str]], list[str]] | None = None,
    base: Callable[[list[str]], DictConfig | None] | None = None,
) -> int:
    """Entry point shared by the commands: ``--help`` prints help (exit 0); otherwise ``argv`` is parsed
    (after ``prepare``; over ``base(argv)`` when it gives a config, e.g. one saved by an earlier run) and
    ``body(cfg)`` runs. A :class:`UsageError` from parsing or from ``body`` prints one line and returns 2;
    ``body``'s return value is the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if is_help(args):
        print(help() if help else help_text(spec))
        return 0
    try:
        if prepare is not None:
            args = prepare(args)
        cfg = parse(spec, args, base=base(args) if base is not None else None)
        return int(body(cfg) or 0)
    except UsageError as exc:
        return fail(spec.prog, str(exc))
