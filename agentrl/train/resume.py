"""What a run must remember to continue exactly: :class:`RunState`, saved with every checkpoint and restored on
resume, and :class:`Checkpoints`, which saves and restores it with the model and the right optimizer.

A checkpoint written inside the SFT stage (``sft_<k>``) holds the SFT optimizer's state; one written after it
(``step_<n>``, step 0 included) holds RL's. Resuming from an SFT-stage checkpoint therefore restores a fresh SFT
optimizer (returned by :meth:`Checkpoints.resume`; the SFT stage then continues with it), and the RL optimizer
starts fresh when the stage ends, exactly as in an uninterrupted run. After the SFT stage, the KL reference is
the SFT'd policy, kept in ``RUN_DIR/sft/reference.pt`` for resumed runs; except in a LoRA run, whose reference
stays the base model with the adapters disabled (nothing to keep: no second copy of the weights).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from agentrl import rundir
from agentrl.train.checkpoint import load_file, load_state_into, save_checkpoint


@dataclass
class RunState:
    """``step``: RL steps done; ``data_position``: the next training task index; ``update_generator``: the
    mini-batch shuffling RNG; ``eval_history``: label (``before``, ``after_sft``, ``step_N``) -> the held-out
    evaluation's headline figures; ``sft_done``, ``sft_step`` (SFT steps done), ``sft_info`` (where its data came
    from, its last loss); ``infra``: the RL steps' episodes that a tool's backend ended (``errors``: left out after
    their runs again; ``retries``: runs again); ``stopped_by``: the budget that ended this process's RL stage early
(``max_wall_s``) or None (not saved: a resumed run starts without one)."""

    seed: int
    step: int = 0
    data_position: int = 0
    sft_done: bool = False
    sft_step: int = 0
    sft_info: dict[str, Any] = field(default_factory=dict)
    eval_history: dict[str, dict[str, Any]] = field(default_factory=dict)
    infra: dict[str, int] = field(default_factory=lambda: {"errors": 0, "retries": 0})
    stopped_by: str | None = None
    update_generator: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.update_generator = torch.Generator().manual_seed(self.seed)

    def to_state(self, *, in_sft: bool) -> dict[str, Any]:
        """The entries of ``state.json`` beyond step and data position."""
        return {
            "update_generator": self.update_generator.get_state().tolist(),
            "eval_history": self.eval_history,
            "sft_done": not in_sft and self.sft_done,
            "sft_step": self.sft_step,
            "sft_info": self.sft_info,
            "infra": self.infra,
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.data_position = int(state["data_position"])
        self.update_generator.set_state(torch.tensor(state["update_generator"], dtype=torch.uint8))
        self.eval_history = dict(state.get("eval_history", {}))
        self.sft_done = bool(state.get("sft_done", True))
        self.sft_step = int(state.get("sft_step", 0))
        self.sft_info = dict(state.get("sft_info", {}))
        self.infra = {"errors": 0, "retries": 0, **{k: int(v) for k, v in state.get("infra", {}).items()}}


@dataclass
class Resumed:
    """What :meth:`Checkpoints.resume` restored: the ``checkpoint`` directory and, for a checkpoint written inside
    the SFT stage, the ``sft_optimizer`` holding its state (None after the stage: RL's optimizer was restored)."""

    checkpoint: str
    sft_optimizer: torch.optim.Optimizer | None


class Checkpoints:
    """Saves and restores a run's checkpoints (model, the optimizer of its stage, RNGs, :class:`RunState`)."""

    def __init__(self, run_dir: str, cfg: Any, parallel: Any, actor: Any, state: RunState) -> None:
        self.run_dir, self.cfg, self.parallel, self.actor, self.state = run_dir, cfg, parallel, actor, state
        self.reference = os.path.join(run_dir, rundir.SFT_DIR, "reference.pt")

    def save(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Write an atomic checkpoint of the current step (rank 0 writes the gathered full states);
        ``optimizer``: the SFT optimizer inside the SFT stage (an ``sft_<k>`` checkpoint), else RL's is saved."""
        in_sft = optimizer is not None
        model, optim, extra = self.parallel.checkpoint_states(self.actor.model, optimizer or self.actor.optimizer)
        if self.parallel.is_main:
            save_checkpoint(
                self.run_dir, step=self.state.step, data_position=self.state.data_position, model=model,
                optimizer=optim, sft_step=self.state.sft_step if in_sft else None,
                extra={**self.state.to_state(in_sft=in_sft), **extra}, keep=self.cfg.trainer.keep_checkpoints,
            )
        self.parallel.barrier()

    def resume(self) -> Resumed | None:
        """Restore the run's latest checkpoint, if any (model, optimizer, RNGs, :class:`RunState`, the KL
        reference after SFT); returns what it restored (None without a checkpoint). Raises RunDirError for a
        damaged ``state.json``."""
        ckpt = rundir.latest_checkpoint(self.run_dir)
        if ckpt is None:
            return None
        sft_optimizer = None
        if not rundir.read_checkpoint_state(ckpt).get("sft_done", True):  # its optimizer state is SFT's
            sft_optimizer = self.actor.sft_optimizer()
        state = self.parallel.load_checkpoint(ckpt, self.actor.model, sft_optimizer or self.actor.optimizer)
        self.state.restore(state)
        ref = self.actor.ref_model
        if ref is not None and ref is not self.actor.model and self.state.sft_done and os.path.exists(self.reference):
            state = load_file(self.reference, map_location=self.actor.model.device)
            load_state_into(ref, state, self.reference)
        return Resumed(ckpt, sft_optimizer)

    def keep_reference(self) -> None:
        """After the SFT stage: the KL reference becomes the SFT'd policy (saved for resumed runs). A LoRA run's
        reference (the model itself, adapters disabled) stays the base model."""
        if self.actor.ref_model is None or self.actor.ref_model is self.actor.model:
            return
        self.actor.ref_model.load_state_dict(self.actor.model.state_dict())
        if self.parallel.is_main:
            os.makedirs(os.path.dirname(self.reference), exist_ok=True)
            torch.save(self.actor.model.state_dict(), self.reference)
