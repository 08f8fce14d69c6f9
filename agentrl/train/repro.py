"""Whether two training runs are the same run: their metrics records with the timings left out, and the weights
of their latest checkpoints, bit for bit.

Two runs of one config and seed on one machine are meant to be identical (see :mod:`agentrl.episodes.lockstep`
for how the rollout keeps the engine's batches and random draws independent of timing). :func:`differing_keys`
names what differs: ``step <s>: <metric>`` for a metric of step ``s`` (or ``step <s>: missing`` for a step only
one run has), ``weights: <tensor>`` for a tensor of the latest checkpoint's model or optimizer state.
Timing keys (``timing_s/*``, ``perf/*``, ``eval/timing_s``, ``eval/latency_s_*``: wall times and rates) are left
out; every other
number must match exactly (NaN matches NaN).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from agentrl import rundir

__all__ = ["deterministic_cpu", "differing_keys", "is_timing_key", "metric_differences", "weight_differences"]


def deterministic_cpu() -> None:
    """Make this process's CPU kernels deterministic (``trainer.deterministic``, on by default for
    ``device=cpu``): ``torch.use_deterministic_algorithms(True)``. Some CPU kernels otherwise accumulate in an
    order that depends on thread scheduling, e.g. ``index_put_(accumulate=True)`` in transformers' default
    MoE experts path, whose expert-bias gradients then differ in the last bit from one run to the next at
    the default thread count. Freshly allocated memory is not filled with NaN (torch's default in this mode):
    that costs time on every allocation and adds nothing to the determinism of what is computed."""
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False


def is_timing_key(key: str) -> bool:
    """A metric that measures time or a rate over time (left out of the comparison)."""
    last = key.split("/")[-1]
    return key.startswith(("timing_s/", "perf/")) or last == "timing_s" or last.startswith("latency_s")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def metric_differences(run_a: str | os.PathLike, run_b: str | os.PathLike) -> list[str]:
    """The ``step <s>: <key>`` entries whose values differ between the two runs' ``metrics.jsonl`` (timing keys
    left out); a step only one run has is ``step <s>: missing``."""
    a = {r["step"]: r for r in rundir.read_metrics(run_a)}
    b = {r["step"]: r for r in rundir.read_metrics(run_b)}
    out: list[str] = []
    for step in sorted(set(a) | set(b)):
        if step not in a or step not in b:
            out.append(f"step {step}: missing")
            continue
        keys = sorted(k for k in set(a[step]) | set(b[step]) if not is_timing_key(k))
        out += [f"step {step}: {k}" for k in keys if not _same(a[step].get(k), b[step].get(k))]
    return out


def _tensors(obj: Any, prefix: str = "") -> dict[str, Any]:
    """The leaves of a (nested) state dict by dotted name."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_tensors(v, f"{prefix}{k}."))
        return out
    if isinstance(obj, (list, tuple)):
        out = {}
        for i, v in enumerate(obj):
            out.update(_tensors(v, f"{prefix}{i}."))
        return out
    return {prefix.rstrip("."): obj}


def _checkpoint_tensors(run: str | os.PathLike) -> dict[str, Any]:
    latest = rundir.latest_checkpoint(run)
    if latest is None:
        raise rundir.RunDirError(f"{run} has no complete checkpoint to compare")
    out: dict[str, Any] = {"checkpoint": Path(latest).name}
    for name in ("model.pt", "optimizer.pt"):
        path = Path(latest) / name
        if path.is_file():
            state = torch.load(path, map_location="cpu", weights_only=True)
            out.update({f"{name}:{k}": v for k, v in _tensors(state).items()})
    adapter = Path(latest) / rundir.ADAPTER_DIR
    if adapter.is_dir():
        out.update({f"adapter:{p.name}": p.read_bytes() for p in sorted(adapter.iterdir()) if p.is_file()})
    return out


def weight_differences(run_a: str | os.PathLike, run_b: str | os.PathLike) -> list[str]:
    """The ``weights: <name>`` entries that differ between the latest checkpoints of the two runs (model and
    optimizer state, bit for bit; ``weights: checkpoint`` when the latest checkpoints are of different steps)."""
    a, b = _checkpoint_tensors(run_a), _checkpoint_tensors(run_b)
    out = []
    for name in sorted(set(a) | set(b)):
        x, y = a.get(name), b.get(name)
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            same = x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        else:
            same = _same(x, y)
        if not same:
            out.append(f"weights: {name}")
    return out


def differing_keys(run_a: str | os.PathLike, run_b: str | os.PathLike) -> list[str]:
    """Everything that differs between two runs (module docstring); empty when they are identical."""
    return metric_differences(run_a, run_b) + weight_differences(run_a, run_b)
