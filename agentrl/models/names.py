"""What a ``model=`` name refers to, decided without loading anything (no torch, no network).

:func:`check_model_name` refuses at once, with one line saying what to give instead, a name that cannot be
loaded for a reason visible on the local disk: a local path that does not exist (``./nope``, ``runs/typo``,
``/abs/path``), a file where a directory is expected, a directory that is neither a saved model nor a
training run, an unknown bare name. Only names that look like hub ids (``org/name``, with no local
directory ``org``) are left for the hub, so a typo in a local path never costs a trip to the network.
"""

from __future__ import annotations

import os

from agentrl.cli_args import suggest
from agentrl.rundir import ADAPTER_DIR, check_weights_file, is_run_dir, latest_checkpoint, read_config_yaml

BUILTIN_MODELS = ("smollm2-135m", "tiny-gpt-oss", "gpt-oss-20b-random")
#: What to do about a damaged checkpoint of a run given as ``model=``.
CHECKPOINT_FIX = "remove that checkpoint directory to use the one before it, or pass another model="
_KINDS = (
    f"a built-in ({', '.join(BUILTIN_MODELS)}), a save_pretrained directory, an agentrl run directory or a hub id "
    "like 'org/name'"
)


def looks_like_path(name: str) -> bool:
    """True if ``name`` can only be meant as a local path: it starts with ``/``, ``./``, ``../`` or ``~``, has
    a backslash, more than one ``/`` or a trailing one, or its first component is an existing local directory
    (``runs/x`` next to a ``runs/`` folder). Hub ids are ``name`` or ``org/name``."""
    if name in (".", "..") or name.startswith(("/", "./", "../", "~")) or "\\" in name or name.endswith("/"):
        return True
    parts = name.split("/")
    return len(parts) > 2 or (len(parts) == 2 and os.path.isdir(parts[0]))


def check_model_name(name: str, *, depth: int = 0) -> None:
    """Raise ``ValueError`` (one line: what is wrong, what to give) for a model name that cannot load for a
    reason the local disk shows; return for built-ins, model directories, hub-id-like names and run directories
    whose ``config.yaml`` reads and names a model that passes this check (a damaged one raises
    :class:`~agentrl.rundir.RunDirError`, a ValueError)."""
    if name in BUILTIN_MODELS:
        return
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        if is_run_dir(path):
            _check_run_model(name, path, depth)
            return
        if os.path.isfile(os.path.join(path, "config.json")):
            return
        raise ValueError(
            f"model directory {name!r} has no config.json: pass a save_pretrained directory or an "
            "agentrl training run directory (with config.yaml and checkpoints/)"
        )
    if os.path.exists(path):
        raise ValueError(f"model={name!r} is a file; give {_KINDS}")
    if looks_like_path(name):
        raise ValueError(f"model={name!r}: no such directory ({os.path.abspath(path)}); give {_KINDS}")
    if "/" not in name:
        hint = suggest(name, BUILTIN_MODELS, n=2, cutoff=0.6)
        raise ValueError(
            f"unknown model {name!r}.{hint} Use a built-in ({', '.join(BUILTIN_MODELS)}), "
            "a local directory with config.json, or a hub id like 'org/name'."
        )


def _check_run_model(name: str, path: str, depth: int) -> None:
    """The training run ``path`` given as ``model=``: its config reads and its own ``model`` is loadable."""
    if depth > 8:
        raise ValueError(f"model={name!r}: its chain of run directories (model= in each config.yaml) is too deep (a loop?)")
    fix = "pass another model=, or restore the file (it was written by agentrl train)"
    base = read_config_yaml(path, fix=fix).get("model")
    if not isinstance(base, str) or not base:
        raise ValueError(f"{os.path.join(path, 'config.yaml')} names no model; {fix}")
    check_model_name(base, depth=depth + 1)
    ckpt = latest_checkpoint(path)
    if ckpt is None:
        raise ValueError(
            f"training run {name!r} has no checkpoint yet (one is written every trainer.save_every steps and at the "
            "end); wait for one or pass the base model"
        )
    if not os.path.isdir(os.path.join(ckpt, ADAPTER_DIR)):  # a full-weights checkpoint
        check_weights_file(os.path.join(ckpt, "model.pt"), fix=CHECKPOINT_FIX)
