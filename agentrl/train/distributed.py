"""Multi-GPU embedded training, the collectives: ``agentrl train ... trainer.n_gpus=N`` under torchrun with FSDP2.

The trainer itself is the single-process one; :class:`agentrl.train.parallel.FSDP2Parallel` tells it what
differs and calls the primitives here. How a run goes:

- :func:`agentrl.train.trainer.run_distributed` re-launches the same ``agentrl train`` command under
  ``torch.distributed.run --standalone --nproc_per_node=N`` (:func:`relaunch`; NVLink multicast stays
  off: :data:`SAFE_ENV` is set in the children unless the caller set those variables), and each child
  joins the process group (:func:`init`) and trains as one rank.
- Every rank loads the model, then :func:`shard` applies FSDP2 (``fully_shard``) to each decoder layer
  and to the root: parameters, gradients and AdamW state are sharded over the ranks; gradients are
  reduce-scattered in fp32.
- Rollout runs on every rank, on its own ``rollout.batch_size / N`` tasks (whole GRPO groups), with the
  parameters gathered once for the whole rollout (:func:`unsharded`): generation then needs no
  collective, so ranks may sample different numbers of tokens.
- The update keeps the single-GPU maths: the step plan is made over all ranks' rows and the loss
  normalisers (token and sequence counts, the response width) are global, so with FSDP's gradient
  averaging each step equals the single-GPU step on the union of the ranks' batches (:func:`global_sum`);
  the logged loss and grad norm are the global ones.
- Rank 0 alone writes metrics and trajectories (all ranks' episodes, gathered).

``device=cpu`` uses the gloo backend with one process per ``trainer.n_gpus`` (for tests); ``device=cuda``
uses NCCL with one GPU per process. Checkpoints gather the full states to rank 0 and keep the single-GPU
directory layout (:meth:`FSDP2Parallel.checkpoint_states <agentrl.train.parallel.FSDP2Parallel.checkpoint_states>`);
``resume=RUN_DIR`` works with any ``n_gpus > 1``.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

#: Set in torchrun children unless already set: NVLink multicast off (see the device notes).
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


# ---------------------------------------------------------------------------- process group
def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def launched_by_torchrun() -> bool:
    """True inside a torchrun child (``LOCAL_RANK`` and ``WORLD_SIZE`` are set)."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def init(device: str) -> torch.device:
    """Join the torchrun process group (NCCL for ``cuda``, gloo for ``cpu``); returns this rank's device."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        if torch.cuda.device_count() <= local:
            raise RuntimeError(
                f"trainer.n_gpus asks for GPU {local} but torch sees {torch.cuda.device_count()}; "
                "lower trainer.n_gpus"
            )
        torch.cuda.set_device(local)
    if not is_distributed():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return torch.device("cuda", local) if device == "cuda" else torch.device("cpu")


def destroy() -> None:
    """Leave the process group (when one was joined)."""
    if is_distributed():
        dist.destroy_process_group()


def torchrun_command(argv: Sequence[str], n_procs: int) -> list[str]:
    """The command that runs ``agentrl train <argv>`` on ``n_procs`` local processes."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n_procs}",
        "-m", "agentrl.cli", "train", *argv,
    ]


def relaunch(argv: Sequence[str], n_procs: int) -> int:
    """Run ``agentrl train <argv>`` under torchrun (see module docstring); returns its exit code."""
    env = {**SAFE_ENV, **os.environ}
    return subprocess.run(torchrun_command(argv, n_procs), env=env).returncode


# ---------------------------------------------------------------------------- FSDP2
def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of an HF causal LM (``model.model.layers``)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__} has no .model.layers; FSDP2 sharding here supports HF decoder-only LMs"
        )
    return list(layers)


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """Apply FSDP2 to each decoder layer and the root (in place); gradients reduce in fp32.

    The trainer scores tokens with the backbone and the LM-head weight directly (no ``[B, S, V]``
    logits), outside the root's ``forward``; ``model.fsdp_token_logprobs`` is registered as an FSDP
    forward method so that path gathers (and reduce-scatters the gradients of) the root's parameters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    from agentrl.train.logprobs import backbone_token_logprobs

    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    model.fsdp_token_logprobs = functools.partial(backbone_token_logprobs, model)
    register_fsdp_forward_method(model, "fsdp_token_logprobs")
    return model


def _fsdp_modules(model: torch.nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def unsharded(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Gather the full parameters on every rank for the duration (a collective on entry and exit);
    inside, forwards run locally with no collective. A no-op for a model without FSDP."""
    modules = _fsdp_modules(model)
    for m in modules:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield model
    finally:
        for m in modules:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)


# ---------------------------------------------------------------------------- reductions
def global_sum(count: torch.Tensor) -> torch.Tensor:
    """``count`` summed over ranks (in fp64, returned in ``count``'s float dtype, fp32 for an integer one);
    ``count`` itself when not distributed.

    The update divides each rank's loss by such global totals and multiplies it by the world size (verl's
    ``global_batch_info``), so that FSDP's gradient average equals the gradient of the loss over all ranks'
    rows, and the rank-averaged logged loss is that loss."""
    if not is_distributed():
        return count
    total = count.detach().clone().to(torch.float64)
    dist.all_reduce(total)
    return total.to(count.dtype if count.is_floating_point() else torch.float32)


def global_max(value: int) -> int:
    """The largest of the ranks' ``value`` (``value`` itself when not distributed)."""
    if not is_distributed():
        return int(value)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    top = torch.tensor([int(value)], dtype=torch.int64, device=device)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    return int(top.item())


def full_value(value: Any) -> float:
    """A Python float of a tensor, a DTensor (all ranks' shards combined) or a number."""
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value)


def average_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Each metric averaged over ranks (every rank must pass the same keys)."""
    if not is_distributed():
        return dict(metrics)
    keys = sorted(metrics)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(values)
    return {k: float(v) / world_size() for k, v in zip(keys, values.tolist(), strict=True)}


def gather_objects(items: list[Any]) -> list[Any]:
    """Every rank's ``items`` concatenated in rank order (on every rank)."""
    if not is_distributed():
        return list(items)
    parts: list[Any] = [None] * world_size()
    dist.all_gather_object(parts, items)
    return [x for part in parts for x in part]


# ---------------------------------------------------------------------------- config
def check_config(cfg: Any, n_procs: int) -> None:
    """Refuse configs the distributed trainer cannot run; raises ValueError saying what to change."""
    if cfg.rollout.batch_size % n_procs:
        raise ValueError(
            f"rollout.batch_size={cfg.rollout.batch_size} must be divisible by trainer.n_gpus={n_procs} "
            "(each rank rolls out whole task groups)"
        )
    from agentrl.envs.registry import env_class

    has_teacher = env_class(cfg.env).scripted_teacher() is not None
    if cfg.sft.steps and (cfg.sft.data or cfg.sft.teacher != "auto" or has_teacher):
        raise ValueError(
            f"sft.steps={cfg.sft.steps} with trainer.n_gpus={n_procs}: the SFT stage runs in the single-process "
            "trainer only; run `agentrl sft ...` first and pass model=runs/<sft run> sft.steps=0"
        )
