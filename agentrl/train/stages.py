"""The stages of a training run, in order: the held-out evaluation before anything, the SFT stage (cold start)
with its evaluation, then the RL stage: steps, evaluations, checkpoints, within the time and failure budgets.

Step 0 (:func:`before_rl`): the evaluation ``before``, then, when ``sft.steps > 0``, the SFT stage
(:func:`sft_stage`: teacher demonstrations through the env, or trajectories from ``sft.data``; its own AdamW,
dropped afterwards) and a second evaluation (``after_sft``), then a checkpoint at step 0. The metrics record of
step 0 holds the evaluation RL starts from as ``eval/*`` and, when SFT ran, the first one as ``eval_before/*``
plus ``sft/*``; SFT's own per-step records are in ``RUN_DIR/sft/metrics.jsonl``.

The RL stage (:func:`rl_stage`) runs :meth:`Trainer.train_step <agentrl.train.trainer.Trainer.train_step>` to
``trainer.total_steps``. A step starts only if it and the final evaluation still fit ``trainer.max_wall_s``;
after ``trainer.max_failed_steps`` consecutive steps in which every episode failed, the run stops with
:class:`TrainingFailed` naming the first exception.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Protocol

from agentrl import rundir, seeds
from agentrl.cli_args import UsageError
from agentrl.episodes import EnvPool
from agentrl.train.free_memory import release_free_memory

if TYPE_CHECKING:
    import torch
    from omegaconf import DictConfig

    from agentrl.episodes import EpisodeResult
    from agentrl.harmony.trajectory import Trajectory
    from agentrl.train.actor import Actor
    from agentrl.train.heldout import HeldOutEvaluation
    from agentrl.train.parallel import SingleProcess
    from agentrl.train.reporting import Reporter
    from agentrl.train.resume import Checkpoints, RunState
    from agentrl.train.sft import SFTStage


class StageContext(Protocol):
    """What the stages read and call of a run (:class:`~agentrl.train.trainer.Trainer` is one): its config,
    state, parts, task stream and the two steps it knows how to take."""

    cfg: DictConfig
    state: RunState
    run_dir: str
    t_created: float  # time.perf_counter() when the run was created (``trainer.max_wall_s`` counts from it)
    env_cls: type
    actor: Actor
    parallel: SingleProcess
    reporter: Reporter
    checkpoints: Checkpoints
    heldout: HeldOutEvaluation

    @property
    def format(self) -> Any:
        """The run's chat format."""

    def make_env(self) -> Any:
        """An env of the run."""

    def train_task(self, index: int) -> tuple[str, dict[str, Any]]:
        """Training task ``index``: its id and its task."""

    async def evaluate(self, pool: EnvPool | None = None, label: str | None = None) -> dict[str, float]:
        """A held-out evaluation of the current weights; its ``eval/*`` metrics."""

    async def train_step(self, pool: EnvPool) -> tuple[dict[str, float], list[EpisodeResult]]:
        """One RL step; its metrics and all ranks' episodes."""

    async def stop_rollouts(self) -> None:
        """Cancel asynchronous rollouts still in flight (none under synchronous rollouts)."""


class TrainingFailed(RuntimeError):
    """The run cannot go on (every episode of several consecutive steps failed); the message names the first
    exception."""


class FailureBudget:
    """Counts consecutive RL steps in which every episode failed; raises :class:`TrainingFailed` at ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit, self.streak, self.first = limit, 0, ""

    def record(self, step: int, episodes: list[EpisodeResult]) -> None:
        """Account for step ``step``'s episodes (all ranks')."""
        if any(e.usable for e in episodes) or not episodes:
            self.streak, self.first = 0, ""
            return
        if not self.streak:
            first = episodes[0]
            self.first = f"step {step}, task {first.task_id}: {first.error or first.reward_error}"
        self.streak += 1
        if self.streak >= self.limit:
            raise TrainingFailed(
                f"every episode failed in {self.streak} consecutive steps (trainer.max_failed_steps={self.limit}); "
                f"the first exception: {self.first}"
            )


class EmptySFTData(UsageError):
    """The SFT stage has no data: its filters (or failed teacher episodes) left nothing. A usage error (one line,
    exit status 2), found before the evaluation that precedes training."""


def _empty_data_message(sft: DictConfig, info: dict[str, Any]) -> str:
    """One line: how many episodes the teacher (or ``sft.data``) gave, why none is kept, what to change."""
    total = info.get("episodes", info.get("read", 0))
    failed = int(info.get("failed") or 0)
    counts = f"{total} episodes from {info.get('source')}, {failed} failed, {info.get('reward_errors', 0)} reward errors"
    if info.get("first_error"):
        counts += f" (the first: {str(info['first_error']).splitlines()[0][:200]})"
    filters = f"sft.min_reward={sft.min_reward}, sft.correct_only={str(bool(sft.correct_only)).lower()}"
    return (f"no SFT data left: {counts}, 0 kept by the filters ({filters}); loosen the filters, fix the env's reward, "
            "or give sft.data=PATH")


async def run_stages(trainer: StageContext, sft_optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """The whole run from where ``trainer.state`` stands; returns the summary. ``sft_optimizer``: the one
    restored from an SFT-stage checkpoint (:meth:`~agentrl.train.resume.Checkpoints.resume`), which the SFT
    stage continues with."""
    from agentrl.train.heldout import pool_size

    pool = EnvPool(trainer.make_env, pool_size(trainer.cfg))
    t_start = time.perf_counter()
    try:
        if trainer.state.step == 0 and not trainer.state.sft_done:
            await before_rl(trainer, pool, sft_optimizer)
        await rl_stage(trainer, pool)
        _export_hf(trainer)
    finally:
        await trainer.stop_rollouts()
        await pool.aclose()
        trainer.reporter.close()
    return trainer.reporter.summary(
        trainer.state, wall_s=time.perf_counter() - t_start, t_created=trainer.t_created,
        load_s=trainer.actor.load_s, stopped_by=trainer.state.stopped_by,
    )


def _export_hf(trainer: StageContext) -> None:
    """``trainer.export_hf``: the last checkpoint's model also in the HF format (one process; rank 0 of a
    parallel run holds no full module, so it keeps ``model.pt`` only). A LoRA run exports its adapter merged
    into the base, loaded anew on the CPU (the trained model is left as it is); its ``adapter/`` stays PEFT's."""
    from agentrl.models.lora import has_lora
    from agentrl.train.checkpoint import export_hf

    ckpt = rundir.latest_checkpoint(trainer.run_dir)
    if not trainer.cfg.trainer.export_hf or ckpt is None:
        return
    if trainer.parallel.world_size > 1:
        trainer.reporter.print(f"HF format: not written by a {trainer.parallel.world_size}-process run (no rank holds "
                               f"the whole model); model={trainer.run_dir} loads its checkpoint in every command")
        return
    model, tokenizer, how = trainer.actor.model, trainer.actor.loaded.tokenizer, ""
    if has_lora(model):
        from agentrl.models.loading import load_model

        merged = load_model(trainer.run_dir, device="cpu", dtype=str(trainer.cfg.dtype))
        model, tokenizer, how = merged.model, merged.tokenizer or tokenizer, ", the LoRA adapter merged into the base"
    out = export_hf(ckpt, model, tokenizer, getattr(trainer.format, "exported_chat_template", lambda: None)())
    if out is not None:
        trainer.reporter.print(f"HF format (save_pretrained{how}): {out}")


async def before_rl(trainer: StageContext, pool: EnvPool, sft_optimizer: torch.optim.Optimizer | None = None) -> None:
    """Step 0: evaluation before anything, the SFT stage (continuing with ``sft_optimizer`` when given) with its
    evaluation, a checkpoint."""
    cfg, state = trainer.cfg, trainer.state
    evaluating = bool(cfg.eval.num_tasks)
    record: dict[str, float] = {}
    t0 = time.perf_counter()
    trajectories = await _sft_data(trainer) if cfg.sft.steps else []  # before the evaluation: no data fails fast
    data_s = time.perf_counter() - t0
    if evaluating and cfg.eval.before and "before" not in state.eval_history:
        record = await trainer.evaluate(pool, "before")
    sft_metrics = await sft_stage(trainer, trajectories, data_s, sft_optimizer)
    if sft_metrics:
        record = {f"eval_before/{k[len('eval/'):]}": v for k, v in record.items()}
        record.update(sft_metrics)
        if evaluating and (cfg.eval.after or cfg.trainer.total_steps > 0):  # in an SFT-only run it is the "after" one
            record.update(await trainer.evaluate(pool, "after_sft"))
    state.sft_done = True
    if sft_metrics:
        trainer.checkpoints.keep_reference()  # RL's KL reference is the policy SFT produced
        if cfg.trainer.save_every:
            trainer.checkpoints.save()
    if record:
        trainer.reporter.sink.log(0, record)


async def rl_stage(trainer: StageContext, pool: EnvPool) -> None:
    """RL steps to ``trainer.total_steps`` with evaluations and checkpoints (module docstring)."""
    cfg, state, reporter = trainer.cfg, trainer.state, trainer.reporter
    budget = FailureBudget(cfg.trainer.max_failed_steps)
    with reporter.progress() as progress:
        bar = progress.add_task("training", total=cfg.trainer.total_steps, completed=state.step) if progress else None
        slowest = 0.0
        while state.step < cfg.trainer.total_steps:
            t_step = time.perf_counter()
            metrics, episodes = await trainer.train_step(pool)
            slowest = max(slowest, time.perf_counter() - t_step)
            out_of_time = _out_of_time(trainer, slowest)
            last = state.step == cfg.trainer.total_steps or out_of_time
            if cfg.eval.num_tasks and ((cfg.eval.every and state.step % cfg.eval.every == 0) or (last and cfg.eval.after)):
                metrics.update(await trainer.evaluate(pool))
            reporter.sink.log(state.step, metrics)  # before the checkpoint: resume cuts records after it
            if cfg.trainer.save_every and (state.step % cfg.trainer.save_every == 0 or last):
                trainer.checkpoints.save()  # before the step line: a printed step is a saved step
            reporter.step_line(state.step, metrics)
            if progress:
                progress.update(bar, completed=state.step)
            budget.record(state.step, episodes)
            if out_of_time:
                state.stopped_by = "max_wall_s"
                reporter.print(
                    f"trainer.max_wall_s={cfg.trainer.max_wall_s:g} reached: stopping after step {state.step} "
                    "(trainer.max_wall_s=0 removes the limit)"
                )
                break


def _out_of_time(trainer: StageContext, slowest_step: float) -> bool:
    """True if another step plus the final evaluation would overrun ``trainer.max_wall_s``."""
    cfg = trainer.cfg
    if not cfg.trainer.max_wall_s:
        return False
    eval_s = trainer.heldout.seconds if cfg.eval.after and cfg.eval.num_tasks else 0.0
    return time.perf_counter() - trainer.t_created + slowest_step + eval_s > cfg.trainer.max_wall_s


async def sft_stage(trainer: StageContext, trajectories: list[Trajectory], data_s: float,
                    optimizer: torch.optim.Optimizer | None = None) -> dict[str, float]:
    """The SFT stage (``sft.*``) on ``trajectories`` (:func:`_sft_data`, made in ``data_s`` seconds):
    ``sft.steps`` optimizer steps with a fresh AdamW (or ``optimizer``, restored from an SFT-stage checkpoint),
    checkpointed every ``sft.save_every`` steps. Resumes at ``state.sft_step``. Returns ``sft/*`` summary
    metrics ({} when there is no SFT stage)."""
    from agentrl.train.sft import SFTStage
    from agentrl.train.sft_data import describe

    cfg, sft, state = trainer.cfg, trainer.cfg.sft, trainer.state
    if sft.steps == 0 or not trajectories:
        return {}
    t0 = time.perf_counter() - data_s
    actor = trainer.actor
    optimizer = optimizer or actor.sft_optimizer()
    stage = SFTStage(
        actor.model, optimizer, trajectories, batch_size=sft.batch_size, micro_batch_size=sft.micro_batch_size,
        pad_token_id=actor.pad_token_id, seed=cfg.seed, grad_clip=sft.grad_clip,
        chunk_size=cfg.actor.logprob_chunk_size, share_prefix=cfg.actor.share_prompt_prefix,
    )
    losses = _sft_steps(trainer, stage, optimizer)
    # the SFT optimizer's state and gradients are not needed any more (RL's first step starts from zero
    # gradients): free them, and the SFT activations malloc kept, before the evaluation and RL
    del stage, optimizer
    actor.model.zero_grad(set_to_none=True)
    release_free_memory()
    state.sft_info.update(steps=sft.steps)
    if losses:
        state.sft_info.update(loss_last=losses[-1])
    return {
        **describe(trajectories), "sft/steps": float(sft.steps), "sft/loss_last": losses[-1] if losses else float("nan"),
        "timing_s/sft_data": data_s, "timing_s/sft": time.perf_counter() - t0,
    }


async def _sft_data(trainer: StageContext) -> list[Trajectory]:
    """The SFT data: the saved ``sft/data.jsonl`` when resumed inside the stage, else :func:`prepare_data`
    (saved there). Raises :class:`EmptySFTData` when the filters leave nothing."""
    from agentrl.train.sft import prepare_data

    cfg, state, reporter = trainer.cfg, trainer.state, trainer.reporter
    data_path = os.path.join(trainer.run_dir, rundir.SFT_DIR, "data.jsonl")
    if state.sft_step > 0 and os.path.exists(data_path):  # resumed inside the stage: the same data
        return rundir.load_trajectories(data_path).records
    trajectories, info = await prepare_data(
        cfg.sft, env_cls=trainer.env_cls, make_env=trainer.make_env,
        task=lambda i: trainer.train_task(seeds.DEMO_TASKS + i)[1], vocab_size=trainer.format.vocab_size,
        seed=seeds.sft_data_seed(cfg.seed), stop_token_ids=list(trainer.format.stop_token_ids),
        progress_interval_s=cfg.trainer.progress_interval_s,
    )
    state.sft_info = {"data": info}
    if not trajectories:
        if "none" in str(info.get("source")):
            reporter.print(f"no SFT stage: {info['source']}")
            return []
        raise EmptySFTData(_empty_data_message(cfg.sft, info))
    rundir.write_trajectories(data_path, trajectories)
    reporter.print(f"SFT data: {len(trajectories)} trajectories ({info})")
    return trajectories


def _sft_steps(trainer: StageContext, stage: SFTStage, optimizer: torch.optim.Optimizer) -> list[float]:
    """Run the SFT steps from ``state.sft_step`` to ``sft.steps``; returns their losses."""
    from agentrl.train.metrics import MetricsSink

    cfg, sft, state = trainer.cfg, trainer.cfg.sft, trainer.state
    sink = MetricsSink(os.path.join(trainer.run_dir, rundir.SFT_DIR), tensorboard=cfg.trainer.tensorboard, wandb=False,
                       wandb_project=cfg.trainer.wandb_project, config={})
    sink.truncate_after(state.sft_step)
    losses: list[float] = []
    try:
        while state.sft_step < sft.steps:
            m = stage.step(state.sft_step)
            state.sft_step += 1
            losses.append(m["sft/loss"])
            sink.log(state.sft_step, m)
            if sft.save_every and state.sft_step % sft.save_every == 0 and state.sft_step < sft.steps:
                trainer.checkpoints.save(optimizer=optimizer)  # before the line below: a printed step is saved
            trainer.reporter.print(
                f"sft {state.sft_step}/{sft.steps}  loss {m['sft/loss']:.4g}  gnorm {m['sft/grad_norm']:.3g}  "
                f"s {m['timing_s/sft_step']:.3g}"
            )
    finally:
        sink.close()
    return losses
