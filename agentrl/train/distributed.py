"""Multi-GPU embedded training: ``agentrl train ... trainer.n_gpus=N`` under torchrun with FSDP2.

How a run goes:

- :func:`run` re-launches the same ``agentrl train`` command under ``torch.distributed.run --standalone
  --nproc_per_node=N`` (NVLink multicast stays off: :data:`SAFE_ENV` is set in the children unless the
  caller set those variables), and each child runs :class:`DistributedTrainer`.
- Every rank loads the model, then :func:`shard` applies FSDP2 (``fully_shard``) to each decoder layer
  and to the root: parameters, gradients and AdamW state are sharded over the ranks; gradients are
  reduce-scattered in fp32.
- Rollout runs on every rank, on its own ``rollout.batch_size / N`` tasks (whole GRPO groups), with the
  parameters gathered once for the whole rollout (:func:`unsharded`): generation then needs no
  collective, so ranks may sample different numbers of tokens.
- The update keeps the single-GPU maths: the loss normalisers (token and sequence counts) are global,
  so with FSDP's gradient averaging the step equals the single-GPU step on the union of the ranks'
  batches (:func:`global_share`); the logged loss and grad norm are the global ones.
- Rank 0 alone writes metrics and trajectories (all ranks' episodes, gathered).

``device=cpu`` uses the gloo backend with one process per ``trainer.n_gpus`` (for tests); ``device=cuda``
uses NCCL with one GPU per process. Checkpoints gather the full states to rank 0 and keep the single-GPU
directory layout (:meth:`DistributedTrainerMixin.save`); ``resume=RUN_DIR`` works with any ``n_gpus > 1``.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
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
def global_share(count: torch.Tensor) -> torch.Tensor:
    """``count`` summed over ranks and divided by the world size (``count`` itself when not distributed).

    A loss normalised by this share on every rank, then averaged by FSDP's gradient reduction, equals
    the loss normalised by the global count."""
    if not is_distributed():
        return count
    total = count.detach().clone().to(torch.float64)
    dist.all_reduce(total)
    return (total / world_size()).to(count.dtype if count.is_floating_point() else torch.float32)


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


# ---------------------------------------------------------------------------- trainer
def _trainer_base() -> type:
    from agentrl.train.trainer import Trainer

    return Trainer


class _NullSink:
    """Metrics sink of ranks other than 0: they log nothing."""

    warnings: list[str] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def truncate_after(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class _FullState:
    """A gathered full state dict, shaped like the module/optimizer ``save_checkpoint`` expects."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        return self._state


def check_config(cfg: Any, n_procs: int) -> None:
    """Refuse configs the distributed trainer cannot run; raises ValueError saying what to change."""
    if cfg.rollout.batch_size % n_procs:
        raise ValueError(
            f"rollout.batch_size={cfg.rollout.batch_size} must be divisible by trainer.n_gpus={n_procs} "
            "(each rank rolls out whole task groups)"
        )
    from agentrl.train.teachers import SCRIPTED_TEACHERS

    if cfg.sft.steps and (cfg.sft.data or cfg.sft.teacher != "auto" or cfg.env in SCRIPTED_TEACHERS):
        raise ValueError(
            f"sft.steps={cfg.sft.steps} with trainer.n_gpus={n_procs}: the SFT stage runs in the single-process "
            "trainer only; run `agentrl sft ...` first and pass model=runs/<sft run> sft.steps=0"
        )


def make_distributed_trainer(cfg: Any) -> Any:
    """A :class:`DistributedTrainer` for ``cfg`` (the process group must be initialised)."""
    return type("DistributedTrainer", (DistributedTrainerMixin, _trainer_base()), {})(cfg)


class DistributedTrainerMixin:
    """Overrides of the embedded ``Trainer`` for FSDP2 over torchrun ranks (see module docstring)."""

    def __init__(self, cfg: Any) -> None:
        from rich.console import Console

        check_config(cfg, world_size())
        super().__init__(cfg, console=None if rank() == 0 else Console(quiet=True))
        shard(self.model)
        if self.ref_model is not None:
            shard(self.ref_model)
        params = [p for p in self.model.parameters() if p.requires_grad]  # now sharded DTensors
        self.optimizer = torch.optim.AdamW(
            params, lr=cfg.actor.lr, betas=tuple(cfg.actor.betas), weight_decay=cfg.actor.weight_decay
        )
        if rank() != 0:
            self.sink.close()
            self.sink = _NullSink()

    def _rank_tasks(self, first: int, count: int) -> tuple[int, list[tuple[str, dict[str, Any]]]]:
        per = count // world_size()
        start = first + rank() * per
        return start, [self.train_task(start + i) for i in range(per)]

    def _save_trajectories(self, name: str, episodes: list[Any]) -> None:
        episodes = gather_objects(list(episodes))
        if rank() == 0:
            super()._save_trajectories(name, episodes)

    async def evaluate(self, pool: Any, label: str | None = None) -> dict[str, float]:
        from agentrl.train.metrics import episode_metrics, eval_summary
        from agentrl.train.rollout import rollout

        label = label or ("before" if self.step == 0 else f"step_{self.step}")
        tasks = self.eval_tasks()[rank() :: world_size()]
        self.engine.reseed(self.cfg.seed + 999_983 + rank())
        with unsharded(self.model):
            result = await rollout(pool, self.engine, self.sampling(self.cfg.eval.temperature), tasks, n=1,
                                   seed=self.cfg.seed + 7_777_777 + rank() * len(tasks))
        self._save_trajectories(f"eval_step_{self.step:06d}", result.episodes)
        metrics = episode_metrics(gather_objects(result.episodes), prefix="eval/")
        metrics["eval/timing_s"] = max(gather_objects([result.wall_s]))
        self.eval_history[label] = {"step": self.step, **eval_summary(metrics)}
        return metrics

    async def train_step(self, pool: Any) -> dict[str, float]:
        from agentrl.train.batch import collate
        from agentrl.train.metrics import episode_metrics
        from agentrl.train.rollout import rollout
        from agentrl.train.update import update_policy

        cfg = self.cfg
        t_step = time.perf_counter()
        step = self.step + 1
        start, tasks = self._rank_tasks(self.data_position, cfg.rollout.batch_size)
        self.engine.reseed(cfg.seed * 1_000_003 + step * world_size() + rank())
        with unsharded(self.model):
            result = await rollout(pool, self.engine, self.sampling(cfg.rollout.temperature), tasks,
                                   n=cfg.rollout.n, seed=cfg.seed * 1_000_003 + start * cfg.rollout.n)
        self._save_trajectories(f"step_{step:06d}", result.episodes)
        metrics = episode_metrics(gather_objects(result.episodes))
        timing = average_metrics({
            "timing_s/rollout": result.wall_s,
            "timing_s/gen": result.gen_s,
            "timing_s/tools": sum(e.tool_s for e in result.episodes),
            "timing_s/env": sum(e.env_s for e in result.episodes),
            "perf/gen_tokens_per_s": result.generated_tokens / max(result.gen_s, 1e-9),
        })
        metrics.update(timing)
        # every rank trains on all its episodes (equal batch shapes keep FSDP's collectives in step);
        # a failed episode keeps its row with a zero loss mask
        trajs = [e.trajectory for e in result.episodes]
        batch = collate(trajs, [e.group for e in result.episodes], self.pad_token_id)
        unusable = torch.tensor([not (e.usable and sum(e.trajectory.response_mask) > 0) for e in result.episodes])
        batch.response_mask[unusable] = 0
        batch = batch.to(self.model.device)
        routing = [e.routing for e in result.episodes] if cfg.actor.routing_replay else None
        update = update_policy(model=self.model, optimizer=self.optimizer, batch=batch, cfg=cfg,
                               temperature=cfg.rollout.temperature, ref_model=self.ref_model,
                               generator=self.update_generator, routing=routing)
        metrics.update(average_metrics(update))
        self.step = step
        self.data_position += cfg.rollout.batch_size
        metrics["training/data_position"] = float(self.data_position)
        metrics["timing_s/step"] = max(gather_objects([time.perf_counter() - t_step]))
        return metrics

    def save(self) -> None:
        """Gather the full model and optimizer states (a collective) and let rank 0 write the checkpoint
        in the single-GPU layout; ``model.pt`` holds plain full tensors under the HF parameter names, and
        ``optimizer.pt`` is keyed by those names (resumable with any ``trainer.n_gpus > 1``)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        from agentrl.train.checkpoint import save_checkpoint

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(self.model, options=options)
        optim_state = get_optimizer_state_dict(self.model, self.optimizer, options=options)
        if rank() == 0:
            save_checkpoint(
                self.run_dir,
                step=self.step,
                data_position=self.data_position,
                model=_FullState(model_state),
                optimizer=_FullState(optim_state),
                extra={
                    "update_generator": self.update_generator.get_state().tolist(),
                    "eval_history": self.eval_history,
                    "n_gpus": world_size(),
                },
                keep=self.cfg.trainer.keep_checkpoints,
            )
        dist.barrier()

    def maybe_resume(self) -> None:
        """Resume from the run's latest checkpoint written by :meth:`save` (every rank reads it)."""
        import json

        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from agentrl.models.checkpoints import latest_checkpoint

        ckpt = latest_checkpoint(self.run_dir)
        if ckpt is None:
            return
        with open(os.path.join(ckpt, "state.json"), encoding="utf-8") as f:
            state = json.load(f)
        if "n_gpus" not in state:
            raise ValueError(
                f"{ckpt} was written by the single-GPU trainer; resume it with trainer.n_gpus=1 "
                "(its optimizer state is keyed by parameter index, not by name)"
            )
        options = StateDictOptions(full_state_dict=True)
        load = lambda name: torch.load(os.path.join(ckpt, name), map_location="cpu", weights_only=True)  # noqa: E731
        set_model_state_dict(self.model, load("model.pt"), options=options)
        set_optimizer_state_dict(self.model, self.optimizer, load("optimizer.pt"), options=options)
        self.step = int(state["step"])
        self.data_position = int(state["data_position"])
        self.update_generator.set_state(torch.tensor(state["update_generator"], dtype=torch.uint8))
        self.eval_history = dict(state.get("eval_history", {}))
        self.sink.truncate_after(self.step)
        self.console.print(f"resumed from {ckpt}: step {self.step}, data position {self.data_position}")


def run(cfg: Any, argv: Sequence[str]) -> int:
    """``agentrl train`` with ``trainer.n_gpus > 1``: relaunch under torchrun, or (inside a torchrun
    child) train as one rank. Returns the exit code; rank 0 prints the summary."""
    import json

    n_procs = int(cfg.trainer.n_gpus)
    if not launched_by_torchrun():
        check_config(cfg, n_procs)
        return relaunch(argv, n_procs)
    if int(os.environ["WORLD_SIZE"]) != n_procs:
        raise RuntimeError(f"torchrun started {os.environ['WORLD_SIZE']} processes but trainer.n_gpus={n_procs}")
    init(cfg.device)
    try:
        summary = make_distributed_trainer(cfg).fit()
        if rank() == 0:
            print(json.dumps(summary, indent=2))
    finally:
        dist.destroy_process_group()
    return 0
