"""The trainer's held-out evaluations, run by ``agentrl eval``'s own runner and metrics.

:func:`held_out_config` turns a training config into the :class:`~agentrl.evaluation.EvalConfig` of its
held-out set: ``eval.num_tasks`` tasks of the ``test`` split of ``data.tasks`` drawn with seed
``seed + eval.seed_offset`` (distinct problems, disjoint from the training stream), one sample each at
``eval.temperature``, the training episodes' env settings (``env_kwargs``, ``rollout.max_turns``,
``data.format_reward``) and token budget, ``model`` = the run directory. It is saved as
``RUN_DIR/eval/config.json``: ``agentrl eval model=RUN_DIR`` starts from it, so it evaluates exactly the
problems behind ``summary.json``'s figures and, on the final weights, reproduces ``eval_after``.

:class:`HeldOutEvaluation` runs it with the trainer's own engine (the weights being trained) through
:func:`agentrl.evaluation.runner.run_jobs`; each evaluation's episodes and metrics go to
``RUN_DIR/eval/<label>/`` (an ``agentrl eval`` directory). Failed episodes are recorded in its
``errors.jsonl`` and left out of the metrics, as in ``agentrl eval``: an episode that a tool's backend ended is
run again, and when it still fails it is incomplete, not a wrong answer. Each evaluation's figures say how many
(``incomplete``: episodes left out, ``infra_errors`` of them a tool's backend ended, ``infra_retries``), and
the tracebacks go to ``RUN_DIR/errors.log``. Under torchrun each rank runs its share and rank 0 writes.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from omegaconf import DictConfig, OmegaConf

from agentrl import errorlog, rundir, seeds
from agentrl.evaluation import EvalConfig
from agentrl.evaluation.config import load_tasks
from agentrl.evaluation.metrics import headline
from agentrl.evaluation.policies import TokenRunner, env_kwargs_of
from agentrl.evaluation.runner import eval_jobs, run_jobs, summarize_items
from agentrl.evaluation.store import ResultStore
from agentrl.harmony.trajectory import Trajectory
from agentrl.progress import ProgressLines


def env_settings(cfg: DictConfig) -> dict[str, Any]:
    """The env constructor arguments of a run's episodes (training and evaluation): ``env_kwargs`` with
    ``rollout.max_turns``."""
    kwargs = dict(OmegaConf.to_container(cfg.env_kwargs, resolve=True))
    if cfg.rollout.max_turns is not None:
        kwargs["max_turns"] = cfg.rollout.max_turns
    return kwargs


def pool_size(cfg: DictConfig) -> int:
    """Episodes in flight, in training and evaluation."""
    return min(cfg.rollout.concurrency, max(cfg.rollout.batch_size * cfg.rollout.n, cfg.eval.num_tasks))


def held_out_config(cfg: DictConfig, run_dir: str) -> EvalConfig:
    """The :class:`~agentrl.evaluation.EvalConfig` of a training run's held-out evaluations (module docstring)."""
    r = cfg.rollout
    return EvalConfig(
        env=cfg.env, model=run_dir, n=1, limit=max(int(cfg.eval.num_tasks), 1), split="test",
        tasks=str(cfg.data.tasks),
        task_seed=int(seeds.held_out_seed(cfg.seed, cfg.eval.seed_offset)), level=int(cfg.data.level),
        format_reward=float(cfg.data.format_reward), api="completions", format=str(cfg.format),
        concurrency=pool_size(cfg), temperature=float(cfg.eval.temperature), top_p=float(r.top_p), top_k=int(r.top_k),
        max_new_tokens=int(r.max_new_tokens), seed=int(cfg.seed), env_kwargs=env_settings(cfg),
        max_batch_size=int(r.max_batch_size), progress=False,
    )


class HeldOutEvaluation:
    """Runs the held-out evaluations of one training run (module docstring)."""

    def __init__(self, cfg: DictConfig, run_dir: str, env_cls: type, actor: Any, parallel: Any) -> None:
        self.cfg, self.env_cls, self.actor, self.parallel = cfg, env_cls, actor, parallel
        self.run = rundir.TrainRun(run_dir)
        self.config = held_out_config(cfg, run_dir)
        self.items = load_tasks(self.config) if cfg.eval.num_tasks else []
        self.seconds = 0.0  # the latest evaluation's wall time (the slowest rank's)

    def save_config(self) -> None:
        """``RUN_DIR/eval/config.json``: the base of ``agentrl eval model=RUN_DIR`` (rank 0)."""
        if self.parallel.is_main and self.items:
            saved = {k: v for k, v in vars(self.config).items() if k not in ("out", "overwrite", "progress", "api_key")}
            rundir.write_json(self.run.held_out_config, saved)

    def runner(self) -> TokenRunner:
        kwargs = {**env_kwargs_of(self.config, self.env_cls), "format": self.actor.format}
        return TokenRunner(self.env_cls, kwargs, self.config, self.actor.engine)

    async def __call__(self, label: str, step: int, pool: Any = None) -> tuple[dict[str, float], dict[str, Any]]:
        """Evaluate the current weights; returns ``(metrics, figures)``: ``eval/*`` metrics for the step's
        record (every :func:`~agentrl.evaluation.summarize` number) and the :func:`~agentrl.evaluation.metrics.
        headline` figures kept in the run's ``eval_history`` / ``summary.json``. ``pool``: the trainer's envs
        (the episodes run on them, as training's do)."""
        par = self.parallel
        collected = _Collected()
        jobs = par.shard_list(eval_jobs(self.config, self.items))
        lines = ProgressLines(f"eval {label}", len(jobs), interval_s=self.cfg.trainer.progress_interval_s)
        with par.gathered(self.actor.model), lines:
            try:
                ran = await run_jobs(self.runner(), jobs, collected, concurrency=self.config.concurrency,
                                     pool=pool, abort_when_all_fail=False, on_progress=lines.update)
            finally:
                release = getattr(self.actor.engine, "release", None)
                if release is not None:  # the decode engine's cache: the update that follows needs the memory
                    release()
        finished, failed = par.gather(collected.finished), par.gather(collected.failed)
        logged = par.gather(collected.logged)
        infra_errors, infra_retries = sum(par.gather([ran.infra_errors])), sum(par.gather([ran.infra_retries]))
        for traj in finished:
            traj.policy_version = step
        if not finished:
            raise RuntimeError(f"every held-out episode failed ({len(failed)}); the first: {failed[0][2]}")
        metrics = summarize_items(self.config, self.items, finished)
        metrics["run"] = {"episodes_failed": len(failed), "infra_errors": infra_errors, "infra_retries": infra_retries}
        if par.is_main:
            self._write(label, finished, failed, metrics)
            for what, text in logged:
                errorlog.append(self.run.root, f"eval {label}, {what}", text)
        self.seconds = par.max(ran.seconds)
        figures = headline(metrics)
        flat = {f"eval/{k}": float(v) for k, v in _numbers({k: v for k, v in metrics.items() if k != "run"}).items()}
        flat.update({"eval/episodes_failed": float(len(failed)), "eval/timing_s": self.seconds,
                     "eval/infra_errors": float(infra_errors), "eval/infra_retries": float(infra_retries)})
        return flat, figures

    def _write(self, label: str, finished: list[Trajectory], failed: list[tuple], metrics: dict[str, Any]) -> None:
        out = self.run.evaluation(label)
        store = ResultStore(out, replace(self.config, out=os.fspath(out), overwrite=True))
        try:
            for traj in finished:
                store.write(traj)
            for item_id, sample, error in failed:
                store.write_error(item_id, sample, error)
        finally:
            store.close()
        store.write_metrics(metrics)


class _Collected:
    """An in-memory result store for :func:`run_jobs` (the ranks' results are gathered, then rank 0 writes)."""

    def __init__(self) -> None:
        self.finished: list[Trajectory] = []
        self.failed: list[tuple[str, int, str]] = []
        self.logged: list[tuple[str, str]] = []

    def write(self, traj: Trajectory) -> None:
        self.finished.append(traj)

    def write_error(self, item_id: str, sample: int, error: str) -> None:
        self.failed.append((item_id, sample, error))

    def log_error(self, what: str, text: str) -> None:
        self.logged.append((what, text))


def _numbers(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric entries of a nested metrics dict, flattened with ``/`` (``errors_per_episode/truncation``)."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if isinstance(v, dict):
            out.update(_numbers(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"{prefix}{k}"] = float(v)
    return out
