"""Atomic checkpoints: model, optimizer, RNG states, data position and step.

Layout (read by :mod:`agentrl.models.checkpoints`, which finds the latest one)::

    RUN_DIR/checkpoints/step_000007/{model.pt, optimizer.pt, rng.pt, state.json}
    RUN_DIR/checkpoints/latest          # text: "step_000007"

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
import shutil
from typing import Any

import numpy as np
import torch

from agentrl.models.checkpoints import checkpoint_root, list_checkpoints


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


def save_checkpoint(
    run_dir: str,
    *,
    step: int,
    data_position: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any] | None = None,
    keep: int = 1,
) -> str:
    """Write checkpoint ``step`` atomically and keep only the newest ``keep``; returns its directory."""
    root = checkpoint_root(run_dir)
    os.makedirs(root, exist_ok=True)
    name = f"step_{step:06d}"
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


def load_checkpoint(path: str, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore model, optimizer and RNG states from checkpoint directory ``path``; returns state.json."""
    device = next(model.parameters()).device
    model.load_state_dict(torch.load(os.path.join(path, "model.pt"), map_location=device, weights_only=True))
    optimizer.load_state_dict(torch.load(os.path.join(path, "optimizer.pt"), map_location=device, weights_only=True))
    set_rng_state(torch.load(os.path.join(path, "rng.pt"), weights_only=False))
    with open(os.path.join(path, "state.json"), encoding="utf-8") as f:
        return json.load(f)
