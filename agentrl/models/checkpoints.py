"""Where a training run keeps its checkpoints, and which one is the latest.

Layout (written by :mod:`agentrl.train.checkpoint`)::

    RUN_DIR/config.yaml                                   the run's resolved config
    RUN_DIR/checkpoints/step_000007/{model.pt, optimizer.pt, rng.pt, state.json}
    RUN_DIR/checkpoints/latest                            text: "step_000007"
    RUN_DIR/checkpoints/sft_000004/...                    written during an SFT stage (before RL step 1)

A checkpoint directory is complete once its ``state.json`` exists (directories are renamed into place
atomically; temporary ones start with ``.tmp-``). ``model.pt`` is a full state dict under the HF
parameter names, whatever the number of GPUs that wrote it. A LoRA run's checkpoint has ``adapter/``
(PEFT's ``adapter_config.json`` + ``adapter_model.safetensors``) instead of ``model.pt``: the adapter only,
the base model being the run's ``model``. Reading this needs no torch.
"""

from __future__ import annotations

import os
import re

ADAPTER_DIR = "adapter"
"""The folder of a checkpoint that holds a LoRA adapter (instead of ``model.pt``)."""
_STEP_DIR = re.compile(r"^(sft|step)_(\d+)$")


def _order(name: str) -> tuple[int, int]:
    """SFT-stage checkpoints (``sft_<k>``) come before RL ones (``step_<n>``), each in numeric order."""
    m = _STEP_DIR.match(name)
    assert m is not None
    return (0 if m.group(1) == "sft" else 1, int(m.group(2)))


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def is_run_dir(path: str) -> bool:
    """True for a training run directory (it has the run's ``config.yaml`` and a ``checkpoints/`` folder)."""
    return os.path.isfile(os.path.join(path, "config.yaml")) and os.path.isdir(checkpoint_root(path))


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
