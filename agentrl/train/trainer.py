"""The training loop: rollout -> batch -> update -> metrics -> checkpoint, resumable.

``Trainer(cfg).fit()`` runs ``cfg.trainer.total_steps`` steps in ``RUN_DIR``. Step ``s`` (1-based) draws
tasks ``data_position .. data_position + rollout.batch_size - 1`` from the env's offline generator (task
``i`` is a pure function of ``(seed, i)``, see :mod:`agentrl.train.tasks`), samples ``rollout.n`` episodes per task,
does the policy update, logs metrics and saves an atomic checkpoint. The engine's sampling generator is
re-seeded from ``(seed, step)`` at each step, so a resumed run samples exactly what the killed one would
have. Held-out evaluation uses a fixed task set from a separate seed stream, at ``eval.temperature``.

Before step 1: the held-out evaluation (``before``), then, when ``sft.steps > 0``, the cold-start SFT stage
(:mod:`agentrl.train.sft`: teacher demonstrations through the env, or trajectories from ``sft.data``; its own
AdamW, dropped afterwards) and a second evaluation (``after_sft``), then a checkpoint at step 0. The
metrics record of step 0 holds the evaluation RL starts from as ``eval/*`` and, when SFT ran, the first
one as ``eval_before/*`` plus ``sft/*``; SFT's own per-step records are in ``RUN_DIR/sft/metrics.jsonl``.

Run directory::

    RUN_DIR/config.yaml          resolved config
    RUN_DIR/metrics.jsonl        one record per step (step 0: evaluation before training)
    RUN_DIR/tensorboard/         TensorBoard events
    RUN_DIR/trajectories/        step_000001.jsonl ..., eval_step_000000.jsonl (before), eval_after_sft.jsonl,
                                 eval_step_000020.jsonl (every episode, failed ones too)
    RUN_DIR/sft/                 data.jsonl (the SFT trajectories), metrics.jsonl, tensorboard/ (SFT stage)
    RUN_DIR/checkpoints/         see agentrl.train.checkpoint
    RUN_DIR/summary.json         eval_before / eval_after_sft / eval_after: mean, sem, tool_call_rate,
                                 tool_success_rate, turns_mean; wall time
"""

from __future__ import annotations

import asyncio
import copy
import difflib
import json
import os
import random
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from agentrl.engines.base import SamplingParams
from agentrl.engines.transformers_engine import TransformersEngine
from agentrl.episodes import EnvPool, EpisodeResult
from agentrl.models.checkpoints import latest_checkpoint
from agentrl.models.loading import load_model
from agentrl.train.batch import collate
from agentrl.train.checkpoint import save_checkpoint
from agentrl.train.config import describe_device_defaults
from agentrl.train.metrics import MetricsSink, NullSink, episode_metrics, eval_summary
from agentrl.train.parallel import SingleProcess
from agentrl.train.rollout import rollout
from agentrl.train.sft_data import save_trajectories
from agentrl.train.tasks import TaskSource, with_boxed_bonus
from agentrl.train.update import update_policy

_DEMO_OFFSET = 1_000_000_000  # SFT demonstrations use training tasks from this index on (RL starts at 0)


def default_run_dir(cfg: DictConfig) -> str:
    kind = "-sft" if cfg.trainer.total_steps == 0 and cfg.sft.steps else ""
    return os.path.join("runs", f"{cfg.env}{kind}-{time.strftime('%Y%m%d-%H%M%S')}")


class Trainer:
    """Owns the model, optimizer, envs and engine of one run. See the module docstring."""

    def __init__(self, cfg: DictConfig, *, console: Any = None, parallel: SingleProcess | None = None) -> None:
        from rich.console import Console

        self.t_created = time.perf_counter()
        self.cfg = cfg
        self.parallel = parallel or SingleProcess()
        self.parallel.check(cfg)
        self.console = console or Console(soft_wrap=True, quiet=not self.parallel.is_main)
        self.console.print(describe_device_defaults(cfg), markup=False, highlight=False)
        self.run_dir = cfg.run_dir or default_run_dir(cfg)
        if cfg.threads:
            torch.set_num_threads(int(cfg.threads))
        if cfg.device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device=cuda but torch sees no CUDA device; use device=cpu")
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)

        import agentrl.envs.registry as registry
        from agentrl.envs.env_kwargs import check_env_kwargs

        try:
            self.env_cls = registry.env_class(cfg.env)
        except KeyError:
            names = sorted(registry.registered())
            close = difflib.get_close_matches(cfg.env, names, n=2)
            hint = f" Did you mean {' or '.join(close)}?" if close else ""
            raise ValueError(f"unknown env {cfg.env!r}.{hint} Registered envs: {', '.join(names)}") from None
        check_env_kwargs(self.env_cls, OmegaConf.to_container(cfg.env_kwargs, resolve=True))  # before the model loads
        generator_kwargs = getattr(self.env_cls, "generator_kwargs", lambda kw: {})(
            OmegaConf.to_container(cfg.env_kwargs, resolve=True)
        )
        self.tasks = TaskSource(self.env_cls, cfg.data.tasks, seed=cfg.seed, level=cfg.data.level,
                                eval_seed=cfg.seed + cfg.eval.seed_offset, num_held_out=cfg.eval.num_tasks,
                                generator_kwargs=generator_kwargs)
        t0 = time.perf_counter()
        self.loaded = load_model(
            cfg.model,
            device=cfg.device,
            dtype=cfg.dtype,
            attn_implementation=cfg.attn_implementation,
            seed=cfg.seed,
            model_kwargs=OmegaConf.to_container(cfg.model_kwargs),
        )
        self.load_s = time.perf_counter() - t0
        self.model = self.loaded.model
        self.format = self.loaded.chat_format(cfg.format)
        self.ref_model = None
        # the KL reference: the initial weights, frozen (copied before any checkpoint is loaded); after an SFT
        # stage, the SFT'd weights (kept in RUN_DIR/sft/reference.pt for resumed runs)
        if cfg.actor.use_kl_loss:
            self.ref_model = copy.deepcopy(self.model).eval()
            self.ref_model.requires_grad_(False)
        if cfg.actor.freeze:
            from agentrl.train.freeze import freeze

            freeze(self.model, list(cfg.actor.freeze))
        if cfg.actor.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.parallel.wrap(self.model)  # before the optimizer: it holds the (sharded) parameters
        if self.ref_model is not None:
            self.parallel.wrap(self.ref_model)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"actor.freeze={list(cfg.actor.freeze)} froze every parameter; nothing to train")
        self.optimizer = torch.optim.AdamW(
            params, lr=cfg.actor.lr, betas=tuple(cfg.actor.betas), weight_decay=cfg.actor.weight_decay
        )
        pad = getattr(self.loaded.tokenizer, "pad_token_id", None) if self.loaded.tokenizer is not None else None
        self.pad_token_id = int(pad if pad is not None else 0)
        if cfg.actor.routing_replay:
            from agentrl.models.routing import find_routers

            find_routers(self.model)  # raises a clear error for dense models
        self.engine = TransformersEngine(
            self.model, pad_token_id=self.pad_token_id, max_batch_size=cfg.rollout.max_batch_size, seed=cfg.seed,
            record_routing=cfg.actor.routing_replay,
        )
        self.step = 0
        self.data_position = 0
        self.update_generator = torch.Generator().manual_seed(cfg.seed)
        self.sink: MetricsSink | NullSink = NullSink()
        if self.parallel.is_main:
            # the run starts (env, model and engine ready): only now is its directory written
            os.makedirs(os.path.join(self.run_dir, "trajectories"), exist_ok=True)
            OmegaConf.save(cfg, os.path.join(self.run_dir, "config.yaml"))
            self.sink = MetricsSink(
                self.run_dir,
                tensorboard=cfg.trainer.tensorboard,
                wandb=cfg.trainer.wandb,
                wandb_project=cfg.trainer.wandb_project,
                config=OmegaConf.to_container(cfg, resolve=True),
            )
        for warning in self.sink.warnings:
            self.console.print(f"[yellow]warning:[/] {warning}")
        self.eval_history: dict[str, dict[str, Any]] = {}  # "before", "after_sft", "step_N" -> eval_summary
        self.eval_seconds = 0.0  # duration of the latest evaluation (to budget the final one)
        self.stopped_early = False
        self.sft_done = False
        self.sft_step = 0  # SFT optimizer steps done
        self.sft_info: dict[str, Any] = {}
        self._resumed_sft_optimizer: torch.optim.Optimizer | None = None

    # ------------------------------------------------------------------ data
    def _make_env(self) -> Any:
        kwargs = dict(OmegaConf.to_container(self.cfg.env_kwargs, resolve=True))
        if self.cfg.rollout.max_turns is not None:
            kwargs["max_turns"] = self.cfg.rollout.max_turns
        if self.cfg.data.format_reward:
            kwargs["rubric"] = with_boxed_bonus(self.env_cls.rubric, self.cfg.data.format_reward)
        return self.env_cls(format=self.format, **kwargs)

    def train_task(self, index: int) -> tuple[str, dict[str, Any]]:
        return f"train-{index}", self.tasks.train(index)

    def eval_tasks(self) -> list[tuple[str, dict[str, Any]]]:
        return [(f"test-{i}", t) for i, t in enumerate(self.tasks.held_out())]

    def sampling(self, temperature: float) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(
            max_new_tokens=r.max_new_tokens,
            temperature=temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            stop_token_ids=list(self.format.stop_token_ids),
        )

    def _save_trajectories(self, name: str, episodes: list[EpisodeResult]) -> None:
        """Write every episode of all ranks (``episodes`` is already gathered); rank 0 only."""
        if not self.cfg.trainer.save_trajectories or not self.parallel.is_main:
            return
        for e in episodes:
            e.trajectory.metadata.setdefault("task_id", e.task_id)
            e.trajectory.metadata["group"] = e.group
        save_trajectories(os.path.join(self.run_dir, "trajectories", f"{name}.jsonl"),
                          (e.trajectory for e in episodes))

    # ------------------------------------------------------------------ resume
    def maybe_resume(self) -> None:
        """Restore the run's latest checkpoint, if any (model, optimizer, step, data position, update
        generator, eval history); the metrics log is cut back to that step."""
        ckpt = latest_checkpoint(self.run_dir)
        if ckpt is None:
            return
        with open(os.path.join(ckpt, "state.json"), encoding="utf-8") as f:
            in_sft = not json.load(f).get("sft_done", True)
        if in_sft:  # an SFT-stage checkpoint: its optimizer state is the SFT optimizer's
            self._resumed_sft_optimizer = self._sft_optimizer()
        state = self.parallel.load_checkpoint(ckpt, self.model, self._resumed_sft_optimizer or self.optimizer)
        self.step = int(state["step"])
        self.data_position = int(state["data_position"])
        self.update_generator.set_state(torch.tensor(state["update_generator"], dtype=torch.uint8))
        self.eval_history = dict(state.get("eval_history", {}))
        self.sft_done = bool(state.get("sft_done", True))
        self.sft_step = int(state.get("sft_step", 0))
        self.sft_info = dict(state.get("sft_info", {}))
        reference = os.path.join(self.run_dir, "sft", "reference.pt")
        if self.ref_model is not None and self.sft_done and os.path.exists(reference):
            self.ref_model.load_state_dict(torch.load(reference, map_location=self.model.device, weights_only=True))
        self.sink.truncate_after(self.step)
        self.console.print(f"resumed from {ckpt}: step {self.step}, data position {self.data_position}")

    def save(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Write an atomic checkpoint of the current step (rank 0 writes the gathered full states);
        ``optimizer``: the SFT optimizer when called inside the SFT stage (an ``sft_<k>`` checkpoint), else
        the RL optimizer is saved."""
        in_sft = optimizer is not None
        model, optim, extra = self.parallel.checkpoint_states(self.model, optimizer or self.optimizer)
        if self.parallel.is_main:
            save_checkpoint(
                self.run_dir,
                step=self.step,
                data_position=self.data_position,
                model=model,
                optimizer=optim,
                sft_step=self.sft_step if in_sft else None,
                extra={
                    "update_generator": self.update_generator.get_state().tolist(),
                    "eval_history": self.eval_history,
                    "sft_done": not in_sft and self.sft_done,
                    "sft_step": self.sft_step,
                    "sft_info": self.sft_info,
                    **extra,
                },
                keep=self.cfg.trainer.keep_checkpoints,
            )
        self.parallel.barrier()

    # ------------------------------------------------------------------ steps
    async def evaluate(self, pool: EnvPool, label: str | None = None) -> dict[str, float]:
        """Greedy (``eval.temperature``) episodes on the held-out tasks; ``eval/*`` metrics over all ranks.
        ``label``: the key in ``eval_history`` (default ``step_N``, or ``before`` at step 0)."""
        label = label or ("before" if self.step == 0 else f"step_{self.step}")
        par = self.parallel
        tasks = par.shard_list(self.eval_tasks())
        self.engine.reseed(self.cfg.seed + 999_983 + par.rank)
        with par.gathered(self.model):
            result = await rollout(pool, self.engine, self.sampling(self.cfg.eval.temperature), tasks, n=1,
                                   seed=self.cfg.seed + 7_777_777 + par.rank * len(tasks))
        episodes = par.gather(result.episodes)
        self._save_trajectories("eval_after_sft" if label == "after_sft" else f"eval_step_{self.step:06d}", episodes)
        metrics = episode_metrics(episodes, prefix="eval/")
        metrics["eval/timing_s"] = par.max(result.wall_s)
        self.eval_seconds = metrics["eval/timing_s"]
        self.eval_history[label] = {"step": self.step, **eval_summary(metrics)}
        return metrics

    def _sft_optimizer(self) -> torch.optim.Optimizer:
        sft = self.cfg.sft
        params = [p for p in self.model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=sft.lr, betas=tuple(self.cfg.actor.betas), weight_decay=sft.weight_decay)

    async def cold_start(self) -> dict[str, float]:
        """The SFT stage (``sft.*``): data (kept in ``RUN_DIR/sft/data.jsonl``), then ``sft.steps`` optimizer
        steps with a fresh AdamW, checkpointed every ``sft.save_every`` steps and dropped afterwards. Resumes
        at ``self.sft_step``. Returns ``sft/*`` summary metrics ({} when there is no SFT stage)."""
        from agentrl.train.sft import SFTStage, prepare_data
        from agentrl.train.sft_data import describe, load_trajectories

        cfg, sft = self.cfg, self.cfg.sft
        if sft.steps == 0:
            return {}
        t0 = time.perf_counter()
        data_path = os.path.join(self.run_dir, "sft", "data.jsonl")
        if self.sft_step > 0 and os.path.exists(data_path):  # resumed inside the stage: the same data
            trajectories, _ = load_trajectories(data_path)
            info = self.sft_info.get("data", {})
        else:
            trajectories, info = await prepare_data(
                sft, env_name=cfg.env, make_env=self._make_env,
                task=lambda i: self.train_task(_DEMO_OFFSET + i)[1], vocab_size=self.format.vocab_size,
                seed=cfg.seed + 31_337, stop_token_ids=list(self.format.stop_token_ids),
            )
            self.sft_info = {"data": info}
            if not trajectories:
                if "none" in str(info.get("source")):
                    self.console.print(f"no SFT stage: {info['source']}")
                    return {}
                raise ValueError(f"the SFT data is empty after filtering ({info}); check sft.data, sft.teacher and the filters")
            save_trajectories(data_path, trajectories)
            self.console.print(f"SFT data: {len(trajectories)} trajectories ({info})")
        data_s = time.perf_counter() - t0
        optimizer = self._resumed_sft_optimizer or self._sft_optimizer()
        self._resumed_sft_optimizer = None
        stage = SFTStage(
            self.model, optimizer, trajectories, batch_size=sft.batch_size, micro_batch_size=sft.micro_batch_size,
            pad_token_id=self.pad_token_id, seed=cfg.seed, grad_clip=sft.grad_clip,
            chunk_size=cfg.actor.logprob_chunk_size, share_prefix=cfg.actor.share_prompt_prefix,
        )
        sink = MetricsSink(os.path.join(self.run_dir, "sft"), tensorboard=cfg.trainer.tensorboard, wandb=False,
                           wandb_project=cfg.trainer.wandb_project, config={})
        sink.truncate_after(self.sft_step)
        losses: list[float] = []
        try:
            while self.sft_step < sft.steps:
                m = stage.step(self.sft_step)
                self.sft_step += 1
                losses.append(m["sft/loss"])
                sink.log(self.sft_step, m)
                if sft.save_every and self.sft_step % sft.save_every == 0 and self.sft_step < sft.steps:
                    self.save(optimizer=optimizer)  # before the line below: a printed step is a saved step
                self.console.print(
                    f"sft {self.sft_step}/{sft.steps}  loss {m['sft/loss']:.4g}  gnorm {m['sft/grad_norm']:.3g}  "
                    f"s {m['timing_s/sft_step']:.3g}"
                )
                self.console.file.flush()
        finally:
            sink.close()
        del optimizer, stage
        self.sft_info.update(steps=sft.steps)
        if losses:
            self.sft_info.update(loss_last=losses[-1])
        return {
            **describe(trajectories), "sft/steps": float(sft.steps), "sft/loss_last": losses[-1] if losses else float("nan"),
            "timing_s/sft_data": data_s, "timing_s/sft": time.perf_counter() - t0,
        }

    async def train_step(self, pool: EnvPool) -> dict[str, float]:
        """Roll out this rank's share of the next ``rollout.batch_size`` tasks, update the policy, and
        return the step's metrics (over all ranks)."""
        cfg, par = self.cfg, self.parallel
        t_step = time.perf_counter()
        step = self.step + 1
        start, count = par.shard_range(self.data_position, cfg.rollout.batch_size)
        tasks = [self.train_task(start + i) for i in range(count)]
        self.engine.reseed(cfg.seed * 1_000_003 + step * par.world_size + par.rank)
        with par.gathered(self.model):
            result = await rollout(pool, self.engine, self.sampling(cfg.rollout.temperature), tasks,
                                   n=cfg.rollout.n, seed=cfg.seed * 1_000_003 + start * cfg.rollout.n)
        episodes = par.gather(result.episodes)
        self._save_trajectories(f"step_{step:06d}", episodes)
        metrics = episode_metrics(episodes)
        metrics.update(par.mean({
            "timing_s/rollout": result.wall_s,
            "timing_s/gen": result.gen_s,
            "timing_s/tools": sum(e.tool_s for e in result.episodes),
            "timing_s/env": sum(e.env_s for e in result.episodes),
            "perf/gen_tokens_per_s": result.generated_tokens / max(result.gen_s, 1e-9),
        }))
        rows, failed = self._training_rows(result.episodes)
        if rows:
            batch = collate([e.trajectory for e in rows], [e.group for e in rows], self.pad_token_id)
            batch.response_mask[failed] = 0
            batch = batch.to(self.model.device)
            update = update_policy(
                model=self.model,
                optimizer=self.optimizer,
                batch=batch,
                cfg=cfg,
                temperature=cfg.rollout.temperature,
                ref_model=self.ref_model,
                generator=self.update_generator,
                routing=[e.routing for e in rows] if cfg.actor.routing_replay else None,
            )
            metrics.update(par.mean(update))
        else:
            metrics["actor/skipped_update"] = 1.0
        self.step = step
        self.data_position += cfg.rollout.batch_size
        metrics["training/data_position"] = float(self.data_position)
        metrics["timing_s/step"] = par.max(time.perf_counter() - t_step)
        return metrics

    def _training_rows(self, episodes: list[EpisodeResult]) -> tuple[list[EpisodeResult], torch.Tensor]:
        """The episodes to collate and a bool mask of the rows whose loss mask is zeroed. One process
        trains on the usable episodes only; ranks of a parallel run keep every row (equal batch shapes
        keep FSDP's collectives in step) and zero the loss mask of failed or empty episodes."""
        trainable = [e.usable and sum(e.trajectory.response_mask) > 0 for e in episodes]
        if self.parallel.equal_batches:
            return list(episodes), ~torch.tensor(trainable, dtype=torch.bool)
        rows = [e for e, ok in zip(episodes, trainable, strict=True) if ok]
        return rows, torch.zeros(len(rows), dtype=torch.bool)

    # ------------------------------------------------------------------ loop
    async def _fit(self) -> dict[str, Any]:
        cfg = self.cfg
        pool = EnvPool(self._make_env, min(cfg.rollout.concurrency, max(cfg.rollout.batch_size * cfg.rollout.n, cfg.eval.num_tasks)))
        t_start = time.perf_counter()
        try:
            if self.step == 0 and not self.sft_done:
                await self._before_rl(pool)
            with self._progress() as progress:
                task = progress.add_task("training", total=cfg.trainer.total_steps, completed=self.step) if progress else None
                slowest_step = 0.0
                while self.step < cfg.trainer.total_steps:
                    t_step = time.perf_counter()
                    metrics = await self.train_step(pool)
                    slowest_step = max(slowest_step, time.perf_counter() - t_step)
                    out_of_time = self._out_of_time(slowest_step)
                    last = self.step == cfg.trainer.total_steps or out_of_time
                    if cfg.eval.num_tasks and ((cfg.eval.every and self.step % cfg.eval.every == 0) or (last and cfg.eval.after)):
                        metrics.update(await self.evaluate(pool))
                    self.sink.log(self.step, metrics)
                    if cfg.trainer.save_every and (self.step % cfg.trainer.save_every == 0 or last):
                        self.save()
                    self._print_step(metrics)
                    if progress:
                        progress.update(task, completed=self.step)
                    if out_of_time:
                        self.stopped_early = True
                        self.console.print(
                            f"trainer.max_wall_s={cfg.trainer.max_wall_s:g} reached: stopping after step {self.step} "
                            "(trainer.max_wall_s=0 removes the limit)"
                        )
                        break
        finally:
            await pool.aclose()
            self.sink.close()
        return self._summary(time.perf_counter() - t_start)

    async def _before_rl(self, pool: EnvPool) -> None:
        """Step 0: evaluation before anything, the SFT stage with its evaluation, a checkpoint."""
        cfg = self.cfg
        evaluating = bool(cfg.eval.num_tasks)
        record: dict[str, float] = {}
        if evaluating and cfg.eval.before and "before" not in self.eval_history:
            record = await self.evaluate(pool, "before")
            self._print_eval(record, "before")
        sft_metrics = await self.cold_start()
        if sft_metrics:
            record = {f"eval_before/{k[len('eval/'):]}": v for k, v in record.items()}
            record.update(sft_metrics)
            if evaluating:
                after = await self.evaluate(pool, "after_sft")
                self._print_eval(after, "after SFT")
                record.update(after)
        self.sft_done = True
        if sft_metrics and self.ref_model is not None:  # RL's KL reference is the policy SFT produced
            self.ref_model.load_state_dict(self.model.state_dict())
            torch.save(self.model.state_dict(), os.path.join(self.run_dir, "sft", "reference.pt"))
        if sft_metrics and cfg.trainer.save_every:
            self.save()
        if record:
            self.sink.log(0, record)

    def _out_of_time(self, slowest_step: float) -> bool:
        """True if another step plus the final evaluation would overrun ``trainer.max_wall_s``."""
        budget = self.cfg.trainer.max_wall_s
        if not budget:
            return False
        eval_s = self.eval_seconds if self.cfg.eval.after and self.cfg.eval.num_tasks else 0.0
        return time.perf_counter() - self.t_created + slowest_step + eval_s > budget

    def fit(self) -> dict[str, Any]:
        """Resume if ``RUN_DIR`` has a checkpoint, train to ``trainer.total_steps``, return the summary."""
        self.maybe_resume()
        return asyncio.run(self._fit())

    # ------------------------------------------------------------------ reporting
    def _progress(self) -> Any:
        from contextlib import nullcontext

        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        if not self.cfg.trainer.progress:
            return nullcontext(None)
        return Progress(
            "[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TimeRemainingColumn(), console=self.console,
        )

    def _print_step(self, m: dict[str, float]) -> None:
        parts = [f"step {self.step}/{self.cfg.trainer.total_steps}"]
        for key, label in (
            ("critic/score/mean", "reward"), ("response_length/mean", "len"), ("episode/tool_calls_mean", "tools/ep"),
            ("episode/tool_error_rate", "tool err"), ("episode/turns_mean", "turns"), ("actor/entropy", "ent"), ("actor/grad_norm", "gnorm"), ("actor/pg_clipfrac", "clip"),
            ("rollout_corr/logprob_abs_diff_mean", "|Δlp|"), ("timing_s/step", "s"),
        ):
            if key in m:
                parts.append(f"{label} {m[key]:.3g}")
        self.console.print("  ".join(parts))
        self.console.file.flush()
        if "eval/critic/score/mean" in m:
            self._print_eval(m)

    def _print_eval(self, m: dict[str, float], label: str | None = None) -> None:
        s = eval_summary(m)
        success = "-" if s["tool_success_rate"] is None else f"{s['tool_success_rate']:.2f}"
        self.console.print(
            f"eval {label or f'@ step {self.step}'}: reward {s['mean']:.3f} ± {s['sem']:.3f} (n={self.cfg.eval.num_tasks})  "
            f"tool calls {s['tool_call_rate']:.2f} of episodes, {s['tool_calls_mean']:.2f}/episode, success {success}  "
            f"turns {s['turns_mean']:.2f}  {m.get('eval/timing_s', 0.0):.0f} s"
        )
        self.console.file.flush()

    def _summary(self, wall_s: float) -> dict[str, Any]:
        summary: dict[str, Any] = {
            "run_dir": self.run_dir, "steps": self.step, "data_position": self.data_position,
            "wall_s_this_process": time.perf_counter() - self.t_created, "fit_s": wall_s,
            "model_load_s": self.load_s, "stopped_early_by_max_wall_s": self.stopped_early,
        }
        if self.sft_info:
            summary["sft"] = self.sft_info
        history = self.eval_history
        if history:
            steps = sorted((v["step"], k) for k, v in history.items() if k not in ("before", "after_sft"))
            first = "before" if "before" in history else ("after_sft" if "after_sft" in history else steps[0][1])
            summary["eval_before"] = history[first]
            if "after_sft" in history:
                summary["eval_after_sft"] = history["after_sft"]
            # no RL step evaluated (an SFT-only run, or total_steps=0): the latest evaluation is the last one
            latest = "after_sft" if "after_sft" in history else first
            summary["eval_after"] = history[steps[-1][1]] if steps else history[latest]
            summary["eval_tasks"] = self.cfg.eval.num_tasks
        if self.parallel.is_main:
            with open(os.path.join(self.run_dir, "summary.json"), "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=2)
        return summary


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
    finally:
        distributed.destroy()
    return 0

