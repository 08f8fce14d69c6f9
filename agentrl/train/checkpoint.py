"""Atomic checkpoints: model, optimizer, RNG states, data position and step.

Layout::

    RUN_DIR/checkpoints/step_000007/{model.pt, optimizer.pt, rng.pt, state.json}
    RUN_DIR/checkpoints/latest          # text: "step_000007"

Checkpoints written during an SFT stage (before RL step 1) are named ``sft_000004`` (SFT step 4); they
order before every ``step_*`` checkpoint, and their ``optimizer.pt`` is the SFT optimizer's state.

A checkpoint is written into ``.tmp-step_000007`` (each file fsynced), then renamed into place, then
``latest`` is replaced atomically (write + ``os.replace``). A crash at any point leaves the previous
checkpoint intact and ``latest`` pointing at a complete directory, so a killed run loses at most the
step in flight. ``state.json`` holds ``{"step", "data_position", ...}``: ``step`` optimizer steps are
done and the next task index to draw is ``data_position``.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from typing import Any

import numpy as np
import torch

_STEP_DIR = re.compile(r"^(sft|step)_(\d+)$")


def _order(name: str) -> tuple[int, int]:
    m = _STEP_DIR.match(name)
    assert m is not None
    return (0 if m.group(1) == "sft" else 1, int(m.group(2)))


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _save_fsync(obj: Any, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def save_checkpoint(
    run_dir: str,
    *,
    step: int,
    data_position: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any] | None = None,
    keep: int = 1,
    sft_step: int | None = None,
) -> str:
    """Write checkpoint ``step`` (or, with ``sft_step``, SFT checkpoint ``sft_<sft_step>``) atomically and keep
    only the newest ``keep``; returns its directory."""
    root = checkpoint_root(run_dir)
    os.makedirs(root, exist_ok=True)
    name = f"step_{step:06d}" if sft_step is None else f"sft_{sft_step:06d}"
    final = os.path.join(root, name)
    tmp = os.path.join(root, f".tmp-{name}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    _save_fsync(model.state_dict(), os.path.join(tmp, "model.pt"))
    _save_fsync(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
    _save_fsync(rng_state(), os.path.join(tmp, "rng.pt"))
    with open(os.path.join(tmp, "state.json"), "w", encoding="utf-8") as f:
        json.dump({"step": step, "data_position": data_position, **(extra or {})}, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if os.path.exists(final):  # re-saving a step (e.g. after a resume) replaces it
        shutil.rmtree(final)
    os.rename(tmp, final)
    latest_tmp = os.path.join(root, ".latest.tmp")
    with open(latest_tmp, "w", encoding="utf-8") as f:
        f.write(name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest_tmp, os.path.join(root, "latest"))
    _fsync_dir(root)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    return final


def list_checkpoints(run_dir: str) -> list[str]:
    """Complete checkpoint directory names, oldest first (temporary ones excluded)."""
    root = checkpoint_root(run_dir)
    if not os.path.isdir(root):
        return []
    names = [n for n in os.listdir(root) if _STEP_DIR.match(n) and os.path.exists(os.path.join(root, n, "state.json"))]
    return sorted(names, key=_order)


def latest_checkpoint(run_dir: str) -> str | None:
    """Directory of the newest complete checkpoint, or None."""
    root = checkpoint_root(run_dir)
    pointer = os.path.join(root, "latest")
    if os.path.exists(pointer):
        with open(pointer, encoding="utf-8") as f:
            name = f.read().strip()
        if os.path.exists(os.path.join(root, name, "state.json")):
            return os.path.join(root, name)
    names = list_checkpoints(run_dir)
    return os.path.join(root, names[-1]) if names else None


def load_checkpoint(path: str, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore model, optimizer and RNG states from checkpoint directory ``path``; returns state.json."""
    device = next(model.parameters()).device
    model.load_state_dict(torch.load(os.path.join(path, "model.pt"), map_location=device, weights_only=True))
    optimizer.load_state_dict(torch.load(os.path.join(path, "optimizer.pt"), map_location=device, weights_only=True))
    set_rng_state(torch.load(os.path.join(path, "rng.pt"), weights_only=False))
    with open(os.path.join(path, "state.json"), encoding="utf-8") as f:
        return json.load(f)
