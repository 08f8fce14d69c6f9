"""Data parallelism as what differs from one process: sharding, reductions and rank-0 IO.

The :class:`~agentrl.train.trainer.Trainer` is written once; it asks its ``parallel`` strategy at each
point where several processes differ from one:

- :meth:`~SingleProcess.wrap`: shard the model (FSDP2) before the optimizer is built over its parameters;
- :meth:`~SingleProcess.gathered`: hold the full parameters for a rollout (generation needs no collective);
- :meth:`~SingleProcess.shard_range` / :meth:`~SingleProcess.shard_list`: this rank's share of the tasks;
- :meth:`~SingleProcess.gather`, :meth:`~SingleProcess.mean`, :meth:`~SingleProcess.max`: all ranks'
  episodes, averaged metrics, the slowest rank's time;
- :attr:`~SingleProcess.equal_batches`: every rank trains on all its episodes so FSDP's collectives stay
  in step (a failed episode keeps its row with a zero loss mask) instead of dropping failed ones;
- :attr:`~SingleProcess.is_main`, :meth:`~SingleProcess.checkpoint_states`,
  :meth:`~SingleProcess.load_checkpoint`, :meth:`~SingleProcess.barrier`: rank 0 writes logs,
  trajectories and checkpoints (full states); every rank reads them back.

:class:`SingleProcess` is the identity of each; :class:`FSDP2Parallel` is one rank of a torchrun job
(:mod:`agentrl.train.distributed` holds the collectives). Seeds are derived as ``... + step * world_size
+ rank``, which is the single-process formula when ``world_size == 1``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from agentrl.train import distributed


class SingleProcess:
    """One process: no sharding, no reductions, and it writes everything."""

    rank = 0
    world_size = 1
    is_main = True
    equal_batches = False

    def check(self, cfg: Any) -> None:
        """Raise ``ValueError`` for a config this strategy cannot run (nothing to check here)."""

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model as this strategy trains it (in place)."""
        return model

    @contextmanager
    def gathered(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """The model with its full parameters available for local generation."""
        yield model

    def shard_range(self, first: int, count: int) -> tuple[int, int]:
        """``(start, n)``: this rank's share of the ``count`` consecutive task indices from ``first``."""
        return first, count

    def shard_list(self, items: Sequence[Any]) -> list[Any]:
        """This rank's share of ``items``."""
        return list(items)

    def gather(self, items: Sequence[Any]) -> list[Any]:
        """Every rank's ``items`` concatenated in rank order."""
        return list(items)

    def mean(self, metrics: dict[str, float]) -> dict[str, float]:
        """Each metric averaged over ranks."""
        return dict(metrics)

    def max(self, value: float) -> float:
        """The largest ``value`` over ranks."""
        return value

    def barrier(self) -> None:
        """Wait for every rank."""

    def checkpoint_states(self, model: Any, optimizer: Any) -> tuple[Any, Any, dict[str, Any]]:
        """``(model, optimizer, extra)`` for :func:`~agentrl.train.checkpoint.save_checkpoint`: objects
        whose ``state_dict()`` is the full state, and entries for ``state.json``."""
        return model, optimizer, {}

    def load_checkpoint(self, path: str, model: Any, optimizer: Any) -> dict[str, Any]:
        """Restore ``model``, ``optimizer`` (and the RNG states) from checkpoint directory ``path``; returns
        its ``state.json``. Checkpoints of multi-GPU runs load too (:func:`~agentrl.train.checkpoint.load_checkpoint`)."""
        from agentrl.train.checkpoint import load_checkpoint

        return load_checkpoint(path, model=model, optimizer=optimizer)


class FSDP2Parallel(SingleProcess):
    """One rank of a torchrun job (the process group already initialised): FSDP2 over the decoder layers,
    each rank rolling out ``rollout.batch_size / world_size`` tasks (whole GRPO groups), global loss
    normalisers (see :func:`agentrl.train.distributed.global_sum`), rank 0 writing."""

    equal_batches = True

    def __init__(self) -> None:
        if not distributed.is_distributed():
            raise RuntimeError("FSDP2Parallel needs an initialised process group (run under torchrun)")
        self.rank = distributed.rank()
        self.world_size = distributed.world_size()
        self.is_main = self.rank == 0

    def check(self, cfg: Any) -> None:
        distributed.check_config(cfg, self.world_size)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return distributed.shard(model)

    @contextmanager
    def gathered(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        with distributed.unsharded(model):
            yield model

    def shard_range(self, first: int, count: int) -> tuple[int, int]:
        per = count // self.world_size
        return first + self.rank * per, per

    def shard_list(self, items: Sequence[Any]) -> list[Any]:
        return list(items)[self.rank :: self.world_size]

    def gather(self, items: Sequence[Any]) -> list[Any]:
        return distributed.gather_objects(list(items))

    def mean(self, metrics: dict[str, float]) -> dict[str, float]:
        return distributed.average_metrics(metrics)

    def max(self, value: float) -> float:
        return max(distributed.gather_objects([value]))

    def barrier(self) -> None:
        torch.distributed.barrier()

    def checkpoint_states(self, model: Any, optimizer: Any) -> tuple[Any, Any, dict[str, Any]]:
        """The full model and optimizer states gathered to CPU (a collective on every rank): ``model.pt``
        holds plain tensors under the HF parameter names and ``optimizer.pt`` is keyed by those names,
        so the checkpoint resumes with any ``trainer.n_gpus > 1`` and loads as a model anywhere. A LoRA
        model gathers its adapter only (:class:`~agentrl.models.lora.AdapterWeights`: ``adapter/``); the
        optimizer state then covers the adapter alone, as the optimizer does."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        from agentrl.models.lora import AdapterWeights, adapter_parameters, has_lora

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        if has_lora(model):  # one all-gather per adapter tensor, in the same order on every rank
            gathered = {name: _full_tensor(p).cpu() for name, p in adapter_parameters(model)}
            model_state: Any = AdapterWeights.of(model, gathered)
        else:
            model_state = _FullState(get_model_state_dict(model, options=options))
        optim_state = get_optimizer_state_dict(model, optimizer, options=options)
        return model_state, _FullState(optim_state), {"n_gpus": self.world_size}

    def load_checkpoint(self, path: str, model: Any, optimizer: Any) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        state = _read_state(path)
        if "n_gpus" not in state:
            raise ValueError(
                f"{path} was written by the single-GPU trainer; resume it with trainer.n_gpus=1 "
                "(its optimizer state is keyed by parameter index, not by name)"
            )
        options = StateDictOptions(full_state_dict=True)

        def load(name: str) -> Any:
            from agentrl.train.checkpoint import load_file

            return load_file(os.path.join(path, name), map_location="cpu")

        from agentrl.models.lora import has_lora
        from agentrl.rundir import ADAPTER_DIR

        if has_lora(model) or os.path.isdir(os.path.join(path, ADAPTER_DIR)):
            from agentrl.train.checkpoint import load_model_state

            load_model_state(path, model)  # the adapter, each rank taking its shards (or a clear mismatch)
        else:
            set_model_state_dict(model, load("model.pt"), options=options)
        set_optimizer_state_dict(model, optimizer, load("optimizer.pt"), options=options)
        return state


class _FullState:
    """A gathered full state dict, shaped like the module/optimizer ``save_checkpoint`` expects."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        return self._state


def _full_tensor(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly FSDP2-sharded) parameter, detached (a collective for a DTensor)."""
    param = param.detach()
    return param.full_tensor() if hasattr(param, "full_tensor") else param


def _read_state(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "state.json"), encoding="utf-8") as f:
        return json.load(f)
