"""Env registry: short names for ``agentrl.make``, Gymnasium ids for ``gymnasium.make``, and third-party
envs discovered through the ``agentrl.envs`` entry-point group.

A third-party package exposes an env with, in its ``pyproject.toml``::

    [project.entry-points."agentrl.envs"]
    myenv = "mypkg.envs:MyEnv"

after which ``agentrl.make("myenv")`` and ``gymnasium.make("agentrl/myenv-v0")`` build it. Registration is
lazy: no env module is imported until the env is made.
"""

from __future__ import annotations

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
        if ep.name.lower() not in _registry:
            register(ep.name, ep.value)


def env_class(name: str) -> type:
    """The env class registered as ``name`` (imported on demand)."""
    key = name.lower()
    if key not in _registry:
        discover()
    if key not in _registry:
        raise KeyError(f"no env named {name!r}; registered envs: {', '.join(sorted(_registry))}")
    module, _, attr = _registry[key][0].partition(":")
    return getattr(import_module(module), attr)


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
    """Build the env registered as ``name`` (``"gsm8k"``, ``"retool"``, ``"verifyif"``, ``"jobs"`` or a
    third-party name) with ``kwargs`` passed to its constructor. Unlike ``gymnasium.make`` it returns the
    env itself, without wrappers, so ``areset``/``astep``/``trajectory`` are directly available."""
    return env_class(name)(**kwargs)


def registered() -> dict[str, str]:
    """Short name -> Gymnasium id of every registered env (third-party ones included)."""
    discover()
    return {k: v[1] for k, v in sorted(_registry.items())}


for _name, (_ep, _gid) in BUILTIN_ENVS.items():
    register(_name, _ep, gym_id=_gid)
