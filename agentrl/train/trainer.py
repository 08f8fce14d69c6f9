"""The training loop: rollout -> batch -> update -> metrics -> checkpoint, resumable.

``Trainer(cfg).fit()`` runs ``cfg.trainer.total_steps`` steps in ``RUN_DIR`` (layout: :mod:`agentrl.rundir`).
Step ``s`` (1-based) draws tasks ``data_position .. data_position + rollout.batch_size - 1`` of the training
stream (task ``i`` is a pure function of ``(seed, i)``, see :class:`agentrl.envs.task_source.TaskSource`),
samples ``rollout.n`` episodes per task, does the policy update (:func:`agentrl.train.update.run_update`),
writes the step's episodes with their train-side log-probs, logs metrics and saves an atomic checkpoint. The
engine's sampling generator is re-seeded from ``(seed, step)`` at each step, so a resumed run samples exactly
what the killed one would have.
With ``rollout.max_staleness > 0`` the batches come from :class:`~agentrl.train.async_rollout.AsyncRollouts`
instead: the same tasks and seeds per step, sampled up to that many updates earlier while earlier steps train.

The parts, one job each: :mod:`~agentrl.train.actor` (model, reference, optimizers, engine),
:mod:`~agentrl.train.resume` (what a checkpoint holds and how a run continues), :mod:`~agentrl.train.heldout`
(held-out evaluations: ``agentrl eval``'s runner and metrics on the run's held-out set),
:mod:`~agentrl.train.stages` (before RL, the SFT stage, the RL stage, the budgets),
:mod:`~agentrl.train.reporting` (console, metrics sinks, ``summary.json``), :mod:`~agentrl.train.update`
(one policy update). Env-specific knowledge stays with the env (its task generator and scripted teacher).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from agentrl import errorlog, rundir, seeds
from agentrl.engines.base import SamplingParams
from agentrl.envs.registry import env_class
from agentrl.envs.task_source import TaskSource
from agentrl.episodes import EnvPool, EpisodeResult
from agentrl.evaluation.policies import env_kwargs_of
from agentrl.train.actor import build_actor
from agentrl.train.async_rollout import AsyncRollouts, staleness_metrics
from agentrl.train.batch import collate
from agentrl.train.config import describe_device_defaults
from agentrl.train.free_memory import release_free_memory
from agentrl.train.heldout import HeldOutEvaluation
from agentrl.train.metrics import episode_metrics
from agentrl.train.parallel import SingleProcess
from agentrl.train.reporting import Reporter, headline
from agentrl.train.repro import deterministic_cpu
from agentrl.train.resume import Checkpoints, RunState
from agentrl.train.rollout import rollout, trainable
from agentrl.train.stages import TrainingFailed, run_stages
from agentrl.train.update import run_update

__all__ = ["Trainer", "TrainingFailed", "default_run_dir", "run_distributed"]


def default_run_dir(cfg: DictConfig) -> str:
    kind = "-sft" if cfg.trainer.total_steps == 0 and cfg.sft.steps else ""
    return os.path.join("runs", f"{cfg.env}{kind}-{time.strftime('%Y%m%d-%H%M%S')}")


class Trainer:
    """One run: its config, env class and task stream, :class:`~agentrl.train.actor.Actor`, state, checkpoints,
    held-out evaluation and reporting. See the module docstring."""

    def __init__(self, cfg: DictConfig, *, console: Any = None, parallel: SingleProcess | None = None) -> None:
        self.t_created = time.perf_counter()
        self.cfg = cfg
        self.parallel = parallel or SingleProcess()
        self.parallel.check(cfg)
        self.run_dir = cfg.run_dir or default_run_dir(cfg)
        self.reporter = Reporter(cfg, self.run_dir, is_main=self.parallel.is_main, console=console)
        self.reporter.print(describe_device_defaults(cfg), markup=False, highlight=False)
        if cfg.threads:
            torch.set_num_threads(int(cfg.threads))
        if cfg.device == "cpu" and cfg.deterministic:
            deterministic_cpu()
        if cfg.device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device=cuda but torch sees no CUDA device; use device=cpu")
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.env_cls = env_class(cfg.env)
        generator_kwargs = self.env_cls.generator_kwargs(OmegaConf.to_container(cfg.env_kwargs, resolve=True))
        self.tasks = TaskSource(self.env_cls, cfg.data.tasks, seed=cfg.seed, level=cfg.data.level,
                                eval_seed=seeds.held_out_seed(cfg.seed, cfg.eval.seed_offset), num_held_out=cfg.eval.num_tasks,
                                generator_kwargs=generator_kwargs)
        self.actor = build_actor(cfg, self.parallel)
        if cfg.actor.lora.rank:
            params = list(self.model.parameters())
            trainable = sum(p.numel() for p in params if p.requires_grad)
            self.reporter.print(f"LoRA rank {cfg.actor.lora.rank}: training {trainable:,} adapter parameters of "
                                f"{sum(p.numel() for p in params):,}", markup=False, highlight=False)
        self.state = RunState(cfg.seed)
        self.checkpoints = Checkpoints(self.run_dir, cfg, self.parallel, self.actor, self.state)
        self.heldout = HeldOutEvaluation(cfg, self.run_dir, self.env_cls, self.actor, self.parallel)
        #: asynchronous rollouts (``rollout.max_staleness > 0``), built at the first step
        self.rollouts: AsyncRollouts | None = None
        self.started = False
        if rundir.latest_checkpoint(self.run_dir) is None:  # a resumed run starts once its checkpoint is restored
            self._start()

    def _start(self) -> None:
        """The run starts (env, model and engine ready; a resumed run's checkpoint and metrics log read): only now
        is its directory written (``config.yaml``, the held-out config) and are the metrics sinks opened."""
        if self.parallel.is_main:
            os.makedirs(rundir.TrainRun(self.run_dir).trajectories, exist_ok=True)
            rundir.write_atomic(rundir.TrainRun(self.run_dir).config, rundir.config_yaml_text(self.cfg))
            self.heldout.save_config()
        self.reporter.open()
        self.started = True

    # the actor's parts, by their usual names
    model = property(lambda self: self.actor.model)
    ref_model = property(lambda self: self.actor.ref_model)
    optimizer = property(lambda self: self.actor.optimizer)
    engine = property(lambda self: self.actor.engine)
    format = property(lambda self: self.actor.format)

    # ------------------------------------------------------------------ data
    def make_env(self) -> Any:
        """An env of the run (training and evaluation episodes alike: ``env_kwargs``, ``rollout.max_turns``,
        the ``data.format_reward`` bonus)."""
        return self.env_cls(format=self.format, **env_kwargs_of(self.heldout.config, self.env_cls))

    def train_task(self, index: int) -> tuple[str, dict[str, Any]]:
        return f"train-{index}", self.tasks.train(index)

    def sampling(self, temperature: float) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=temperature, top_p=r.top_p,
                              top_k=r.top_k, stop_token_ids=list(self.format.stop_token_ids))

    # ------------------------------------------------------------------ steps
    async def evaluate(self, pool: EnvPool | None = None, label: str | None = None) -> dict[str, float]:
        """A held-out evaluation of the current weights (:class:`~agentrl.train.heldout.HeldOutEvaluation`);
        kept in ``state.eval_history[label]`` (default ``step_N``, or ``before`` at step 0) and printed. Returns
        the ``eval/*`` metrics."""
        step = self.state.step
        label = label or ("before" if step == 0 else f"step_{step}")
        directory = label if label in ("before", "after_sft") else f"step_{step:06d}"
        metrics, figures = await self.heldout(directory, step, pool)
        release_free_memory()  # the evaluation's KV caches, freed on the engine's threads
        self.state.eval_history[label] = {"step": step, **figures}
        self.reporter.evaluation(figures, {"before": "before", "after_sft": "after SFT"}.get(label, f"@ step {step}"),
                                 metrics["eval/timing_s"])
        return metrics

    async def train_step(self, pool: EnvPool) -> tuple[dict[str, float], list[EpisodeResult]]:
        """Roll out this rank's share of the next ``rollout.batch_size`` tasks, update the policy, write the
        episodes (with their train-side log-probs); returns the step's metrics and all ranks' episodes."""
        cfg, par, state = self.cfg, self.parallel, self.state
        t_step = time.perf_counter()
        if self.rollouts is None and cfg.rollout.max_staleness:  # after a resume restored the weights
            self.rollouts = AsyncRollouts(self)
        if self.rollouts is not None:  # asynchronous: the batch started up to max_staleness versions ago
            result = await self.rollouts.next_batch(pool)
        else:
            start, count = par.shard_range(state.data_position, cfg.rollout.batch_size)
            tasks = [self.train_task(start + i) for i in range(count)]
            self.engine.reseed(seeds.engine_seed(cfg.seed, state.step + 1, par.world_size, par.rank))
            with par.gathered(self.model):
                result = await rollout(pool, self.engine, self.sampling(cfg.rollout.temperature), tasks,
                                       n=cfg.rollout.n, seed=seeds.rollout_seed(cfg.seed, start, cfg.rollout.n),
                                       progress_interval_s=cfg.trainer.progress_interval_s)
            for e in result.episodes:
                e.trajectory.policy_version = state.step  # sampled with the weights of `step` updates
        release_free_memory()  # the rollout's KV caches, before the update's activations
        if self.rollouts is not None:
            update = await self.rollouts.update(self._update, result.episodes)
        else:
            update = self._update(result.episodes)
        self.optimizer.zero_grad(set_to_none=True)  # every update starts from none: no memory for them till then
        release_free_memory()  # the update's activations and gradients, before the next rollout or evaluation
        episodes = par.gather(result.episodes)
        self._save_trajectories(state.step + 1, episodes)
        self._log_failures(state.step + 1, episodes)
        state.infra["errors"] += sum(1 for e in episodes if e.infrastructure)
        state.infra["retries"] += sum(e.retries for e in episodes)
        metrics = episode_metrics(episodes)
        metrics.update(par.mean({
            "timing_s/rollout": result.wall_s,
            "timing_s/gen": result.gen_s,
            "timing_s/tools": sum(e.tool_s for e in result.episodes),
            "timing_s/env": sum(e.env_s for e in result.episodes),
            "perf/gen_tokens_per_s": result.generated_tokens / max(result.gen_s, 1e-9),
        }))
        metrics.update(update)
        if self.rollouts is not None:
            metrics.update(staleness_metrics(result.episodes, state.step))
        state.step += 1
        state.data_position += cfg.rollout.batch_size
        if self.rollouts is not None:
            self.rollouts.publish()  # the new weights to the sampler; start the batches they admit
        metrics["training/data_position"] = float(state.data_position)
        metrics["timing_s/step"] = par.max(time.perf_counter() - t_step)
        if self.model.device.type == "cuda":  # the run's peak so far (weights, optimizer, activations, KV cache)
            metrics["perf/gpu_peak_gb"] = par.max(torch.cuda.max_memory_allocated(self.model.device) / 1e9)
        return metrics, episodes

    def _update(self, episodes: list[EpisodeResult]) -> dict[str, float]:
        """The policy update on this rank's episodes; records each trained episode's train-side log-probs.
        One process trains on the :func:`~agentrl.train.rollout.trainable` episodes only; ranks of a parallel run
        keep every row (equal batch shapes keep FSDP's collectives in step), zero the loss mask of the others and
        give each of those a group of its own, so that its reward is in no other sample's baseline."""
        keep = trainable(episodes)
        dropped = len({e.group for e in episodes if e.group is not None}) - len(
            {e.group for e, k in zip(episodes, keep, strict=True) if k and e.group is not None})
        equal = self.parallel.equal_batches
        rows = list(episodes) if equal else [e for e, ok in zip(episodes, keep, strict=True) if ok]
        if not rows:
            return {"actor/skipped_update": 1.0, "actor/dropped_groups": float(dropped)}
        groups = [e.group if not equal or keep[i] else -1 - i for i, e in enumerate(rows)]
        batch = collate([e.trajectory for e in rows], groups, self.actor.pad_token_id)
        if equal:
            batch.response_mask[~torch.tensor(keep, dtype=torch.bool)] = 0
        update = run_update(
            model=self.model, optimizer=self.optimizer, batch=batch.to(self.model.device), cfg=self.cfg,
            temperature=self.cfg.rollout.temperature, ref_model=self.ref_model,
            generator=self.state.update_generator,
            routing=[e.routing for e in rows] if self.cfg.actor.routing_replay else None,
        )
        if update.old_log_prob is not None:
            old = update.old_log_prob.float().cpu()
            for i, e in enumerate(rows):
                if not equal or keep[i]:
                    mask = e.trajectory.response_mask
                    lps = old[i, : len(mask)].tolist()
                    e.trajectory.train_logprobs = [v if m else 0.0 for v, m in zip(lps, mask, strict=True)]
        return self.parallel.mean({**update.metrics, "actor/dropped_groups": float(dropped)})

    def _save_trajectories(self, step: int, episodes: list[EpisodeResult]) -> None:
        """Write every episode of step ``step`` (all ranks'; failed ones too); rank 0 only."""
        if self.cfg.trainer.save_trajectories and self.parallel.is_main:
            rundir.write_trajectories(rundir.TrainRun(self.run_dir).step_trajectories(step),
                                      (e.trajectory for e in episodes))

    def _log_failures(self, step: int, episodes: list[EpisodeResult]) -> None:
        """Append the tracebacks of step ``step``'s failed episodes (and of their runs again) to
        ``RUN_DIR/errors.log`` (:mod:`agentrl.errorlog`); rank 0 only."""
        if self.parallel.is_main:
            for e in episodes:
                for what, text in e.failures():
                    errorlog.append(self.run_dir, f"step {step}, {what}", text)

    async def stop_rollouts(self) -> None:
        """Cancel asynchronous batches still in flight (a run that stopped early); before the env pool closes."""
        if self.rollouts is not None:
            await self.rollouts.aclose()

    # ------------------------------------------------------------------ run
    def maybe_resume(self) -> torch.optim.Optimizer | None:
        """Restore the run's latest checkpoint, if any; the metrics log is cut back to its step. Returns the SFT
        optimizer restored from a checkpoint written inside the SFT stage (else None). A damaged checkpoint or
        metrics log raises :class:`~agentrl.rundir.RunDirError` before anything in the run directory is
        written."""
        resumed = self.checkpoints.resume()
        if resumed is not None and self.parallel.is_main:
            rundir.truncate_metrics(rundir.TrainRun(self.run_dir).metrics, self.state.step)
        if not self.started:
            self._start()
        if resumed is None:
            return None
        self.reporter.print(f"resumed from {resumed.checkpoint}: step {self.state.step}, "
                            f"data position {self.state.data_position}")
        return resumed.sft_optimizer

    def fit(self) -> dict[str, Any]:
        """Resume if ``RUN_DIR`` has a checkpoint, train to ``trainer.total_steps``, return the summary."""
        sft_optimizer = self.maybe_resume()
        return asyncio.run(run_stages(self, sft_optimizer))


def run_distributed(cfg: DictConfig, argv: Sequence[str]) -> int:
    """``agentrl train`` with ``trainer.n_gpus > 1``: relaunch under torchrun, or (inside a torchrun child)
    train as one rank of :class:`~agentrl.train.parallel.FSDP2Parallel`. Returns the exit code; rank 0
    prints the summary."""
    from agentrl.train import distributed
    from agentrl.train.parallel import FSDP2Parallel

    n_procs = int(cfg.trainer.n_gpus)
    if not distributed.launched_by_torchrun():
        distributed.check_config(cfg, n_procs)
        return distributed.relaunch(argv, n_procs)
    if int(os.environ["WORLD_SIZE"]) != n_procs:
        raise RuntimeError(f"torchrun started {os.environ['WORLD_SIZE']} processes but trainer.n_gpus={n_procs}")
    distributed.init(cfg.device)
    try:
        summary = Trainer(cfg, parallel=FSDP2Parallel()).fit()
        if distributed.rank() == 0:
            print(json.dumps(summary, indent=2))
            print(headline(summary))
    finally:
        distributed.destroy()
    return 0
