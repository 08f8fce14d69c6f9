"""Env registry: short names for ``agentrl.make``, Gymnasium ids for ``gymnasium.make``, and third-party
envs discovered through the ``agentrl.envs`` entry-point group.

A third-party package exposes an env with, in its ``pyproject.toml``::

    [project.entry-points."agentrl.envs"]
    myenv = "mypkg.envs:MyEnv"

after which ``agentrl.make("myenv")`` and, after a plain ``import agentrl``, ``gymnasium.make("agentrl/myenv-v0")``
build it: importing this module registers the built-in envs and the entry-point group's envs with Gymnasium
(reading the installed packages' metadata, not importing them). No env module is imported until the env is made.
"""

from __future__ import annotations

import os
import sys
import warnings
from importlib import import_module
from importlib.metadata import entry_points
from typing import Any

import gymnasium

ENTRY_POINT_GROUP = "agentrl.envs"

#: short name -> (entry point "module:Class", Gymnasium id)
BUILTIN_ENVS: dict[str, tuple[str, str]] = {
    "gsm8k": ("agentrl.envs.builtin.gsm8k:GSM8KEnv", "agentrl/GSM8K-v0"),
    "retool": ("agentrl.envs.builtin.retool:ReToolEnv", "agentrl/ReTool-v0"),
    "verifyif": ("agentrl.envs.builtin.verifyif:VerifyIFEnv", "agentrl/VerifyIF-v0"),
    "jobs": ("agentrl.envs.builtin.jobs.env:JobsEnv", "agentrl/Jobs-v0"),
}

_registry: dict[str, tuple[str, str]] = {}
_discovered = False


def register(name: str, entry_point: str, *, gym_id: str | None = None) -> str:
    """Register an env class (``"module:Class"``) under a short name and a Gymnasium id
    (default ``agentrl/<name>-v0``). Returns the Gymnasium id. Re-registering a name replaces it."""
    if ":" not in entry_point:
        raise ValueError(f"entry_point must look like 'package.module:ClassName', got {entry_point!r}")
    gym_id = gym_id or f"agentrl/{name}-v0"
    _registry[name.lower()] = (entry_point, gym_id)
    if gym_id in gymnasium.registry:
        del gymnasium.registry[gym_id]
    gymnasium.register(id=gym_id, entry_point=entry_point, disable_env_checker=False)
    return gym_id


def discover() -> None:
    """Register the envs that installed packages declare in the ``agentrl.envs`` entry-point group
    (once per process; built-in names win on a clash)."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name.lower() in _registry:
            continue
        try:
            register(ep.name, ep.value)
        except ValueError as exc:  # one package's bad metadata must not break `import agentrl`
            warnings.warn(f"ignoring the {ENTRY_POINT_GROUP} entry point {ep.name!r} = {ep.value!r}: {exc}", stacklevel=2)


def is_reference(name: str) -> bool:
    """True for an env given by reference (``"module:Class"`` or ``"path/to/file.py:Class"``), not by name."""
    return ":" in name


class UnknownEnv(KeyError, ValueError):
    """No env is registered under the name, and it is no reference; a KeyError (a failed lookup) and a ValueError
    (a bad argument) both. Its ``str`` is the message itself."""

    def __str__(self) -> str:
        return str(self.args[0])


def env_class(name: str) -> type:
    """The env class registered as ``name`` (imported on demand), or the one ``name`` refers to:
    ``"package.module:Class"`` (an importable module; the current directory is searched as well, so a module
    next to where the command runs needs no packaging) or ``"path/to/file.py:Class"``.

    Raises:
        UnknownEnv: ``name`` is neither registered nor a reference (the message suggests close names).
        ValueError: a reference whose module or file cannot be imported, or that names no env class there
            (the message says which and what to do).
    """
    key = name.lower()
    if key not in _registry:
        discover()
    if key in _registry:
        module, _, attr = _registry[key][0].partition(":")
        return getattr(import_module(module), attr)
    if is_reference(name):
        return _load_reference(name)
    from agentrl.cli_args import suggest  # here: importing the env SDK reads no config library

    raise UnknownEnv(f"no env named {name!r}; registered envs: {', '.join(sorted(_registry))}."
                     f"{suggest(name, sorted(_registry), n=2, cutoff=0.6)}")


def _load_reference(reference: str) -> type:
    target, _, attr = reference.rpartition(":")
    if not target or not attr.isidentifier():
        raise ValueError(f"env={reference!r}: a reference looks like 'package.module:ClassName' or 'path/to/file.py:ClassName'")
    if target.endswith(".py") or os.sep in target or "/" in target:
        module = _import_file(target, reference)
    else:
        module = _import_module(target, reference)
    cls = getattr(module, attr, None)
    if not _is_agent_env(cls):
        found = sorted(k for k, v in vars(module).items() if _is_agent_env(v))
        what = "is not an AgentEnv subclass" if cls is not None else "does not exist"
        raise ValueError(
            f"env={reference!r}: {target}.{attr} {what}; AgentEnv subclasses there: {', '.join(found) or 'none'}"
        )
    return cls


def _is_agent_env(obj: Any) -> bool:
    """True for a subclass of :class:`~agentrl.envs.env.AgentEnv` (not AgentEnv itself), told by its bases'
    names: ``agentrl.envs.env`` imports this module, so this module does not import it."""
    if not isinstance(obj, type):
        return False
    bases = [f"{c.__module__}.{c.__qualname__}" for c in obj.__mro__[1:]]
    return "agentrl.envs.env.AgentEnv" in bases


def _import_module(target: str, reference: str) -> Any:
    """``target`` imported; when it is not found, again with the current directory on ``sys.path`` (the
    ``agentrl`` console script does not search it)."""
    try:
        return _import(target, reference)
    except ModuleNotFoundError as exc:
        error = _not_found(exc, target, reference, cwd_searched="" in sys.path or os.getcwd() in sys.path)
        if error is not None:
            raise error from None
    sys.path.insert(0, os.getcwd())
    try:
        return _import(target, reference)
    except ModuleNotFoundError as exc:
        raise _not_found(exc, target, reference, cwd_searched=True) or exc from None


def _not_found(exc: ModuleNotFoundError, target: str, reference: str, *, cwd_searched: bool) -> ValueError | None:
    """The error for a failed import of ``target``, or None when ``target`` itself was not found and the current
    directory has not been searched yet (then it is worth a second try)."""
    if not (exc.name is not None and (target == exc.name or target.startswith(exc.name + "."))):
        return ValueError(f"env={reference!r}: importing {target} failed: {exc}")  # a missing import inside it
    if not cwd_searched:
        return None
    return ValueError(
        f"env={reference!r}: {exc} (searched the installed packages and {os.getcwd()}); run from the directory "
        "that holds the module, or give its file: env=path/to/module.py:ClassName"
    )


def _import(target: str, reference: str) -> Any:
    """``import_module(target)``; a failure other than a missing module becomes a ValueError naming it."""
    try:
        return import_module(target)
    except ModuleNotFoundError:
        raise
    except Exception as exc:
        raise ValueError(f"env={reference!r}: importing {target} failed: {type(exc).__name__}: {exc}") from exc


def _import_file(path: str, reference: str) -> Any:
    """The module of ``path``, run once, with its folder first on ``sys.path`` as ``python path`` would put it,
    so that it imports the modules next to it."""
    import importlib.util

    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(full):
        raise ValueError(f"env={reference!r}: no file {path!r} (looked at {full})")
    name = "agentrl_user_env." + os.path.splitext(os.path.basename(full))[0]
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == full:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, full)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    folder = os.path.dirname(full)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ValueError(f"env={reference!r}: running {path} failed: {type(exc).__name__}: {exc}") from exc
    return module


def name_of(cls: type) -> str:
    """The short name ``cls`` is registered under (the first, if several), else its class name: what a
    trajectory records as its ``env``. Imports no env module."""
    entry = f"{cls.__module__}:{cls.__qualname__}"
    for name, (entry_point, _) in _registry.items():
        if entry_point == entry:
            return name
    discover()
    return next((name for name, (ep, _) in _registry.items() if ep == entry), cls.__name__)


def make(name: str, **kwargs: Any) -> Any:
    """Build the env registered as ``name`` (``"gsm8k"``, ``"retool"``, ``"verifyif"``, ``"jobs"``, a
    third-party name, or a ``"module:Class"`` / ``"file.py:Class"`` reference, see :func:`env_class`) with
    ``kwargs`` passed to its constructor. Unlike ``gymnasium.make`` it returns the env itself, without
    wrappers, so ``areset``/``astep``/``trajectory`` are directly available."""
    return env_class(name)(**kwargs)


def registered() -> dict[str, str]:
    """Short name -> Gymnasium id of every registered env (third-party ones included)."""
    discover()
    return {k: v[1] for k, v in sorted(_registry.items())}


for _name, (_ep, _gid) in BUILTIN_ENVS.items():
    register(_name, _ep, gym_id=_gid)
discover()
