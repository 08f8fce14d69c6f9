"""``agentrl eval`` orchestration: run an env's evaluation tasks against a model and write every trajectory as
it finishes (:class:`Evaluation`).

The episodes run concurrently over a pool of envs (:func:`agentrl.episodes.collect`), each driven by the
policy its ``api`` gives (:mod:`agentrl.evaluation.policies`); finished ones go to the run directory at
once (:mod:`agentrl.evaluation.store`); ``processes > 1`` splits them over client processes. What is
evaluated is an :class:`~agentrl.evaluation.config.EvalConfig`. Nothing is written before the run starts
(its tasks loaded): a run that fails to start leaves no directory behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from agentrl.episodes import EnvPool, EpisodeJob, EpisodeResult, collect
from agentrl.evaluation.answers import answers_comparable, comparable_answer
from agentrl.evaluation.config import EvalConfig, load_tasks
from agentrl.evaluation.metrics import summarize
from agentrl.evaluation.policies import EpisodeRunner, open_runner
from agentrl.evaluation.store import ResultStore, items_digest
from agentrl.harmony.trajectory import Trajectory

__all__ = ["Evaluation", "JobCounts", "eval_jobs", "run_async", "run_jobs", "summarize_items"]


def eval_jobs(config: EvalConfig, items: list[tuple[str, dict[str, Any]]], done: set | frozenset = frozenset()) -> list[EpisodeJob]:
    """The episodes of an evaluation: ``config.n`` samples of each ``(item_id, task)``, sample ``j`` with env
    seed ``config.seed + j``, in item order; pairs in ``done`` (``(item_id, sample)``) are left out."""
    return [
        EpisodeJob(task, config.seed + j, item_id, sample=j)
        for item_id, task in items
        for j in range(config.n)
        if (item_id, j) not in done
    ]


@dataclass
class JobCounts:
    """What :func:`run_jobs` ran: ``finished`` and ``failed`` episodes, ``seconds`` from the first episode's start
    to the last one's end, ``infra_errors`` (the failed episodes that a tool's backend ended, after their runs
    again: incomplete, not wrong) and ``infra_retries`` (runs again after such a failure)."""

    finished: int = 0
    failed: int = 0
    seconds: float = 0.0
    infra_errors: int = 0
    infra_retries: int = 0


async def run_jobs(
    runner: EpisodeRunner, jobs: list[EpisodeJob], store: Any, *, concurrency: int,
    on_progress: Callable[[int, int, int], Any] | None = None, pool: EnvPool | None = None,
    abort_when_all_fail: bool = True,
) -> JobCounts:
    """Run ``jobs`` with ``runner`` over a pool of ``concurrency`` envs (:func:`agentrl.episodes.collect`; or over
    ``pool``, left open, e.g. the trainer's), handing each result to ``store`` as it finishes: a finished
    episode to ``store.write`` (its trajectory labelled by :meth:`EpisodeRunner.label`), a failed one to
    ``store.write_error`` (it is not in the metrics; ``agentrl eval`` retries it on the next run), and the
    tracebacks of every failure (:meth:`~agentrl.episodes.EpisodeResult.failures`, runs again after an
    infrastructure failure included) to ``store.log_error(what, text)``. An episode that a tool's backend ended
    is run again by :func:`~agentrl.episodes.collect`, and when it still fails it is a failed episode: left out
    of the score, never a wrong answer. With ``abort_when_all_fail``, stops early when every episode so far
    failed (``2 * concurrency + 2`` in a row: the model is unreachable) and then raises RuntimeError with the
    last error. ``on_progress(done, total, failed)``: at the start and after each episode."""
    if not jobs:
        return JobCounts()
    counts = {"done": 0, "failed": 0, "streak": 0, "infra_errors": 0, "infra_retries": 0}
    abort_after = 2 * concurrency + 2
    last_error: list[str] = []

    def finished(result: EpisodeResult) -> None:
        runner.finished(result)
        for what, text in result.failures():
            store.log_error(what, text)
        counts["infra_retries"] += result.retries
        if result.error is not None:
            store.write_error(str(result.task_id), result.sample, result.error)
            last_error[:] = [result.error]
            counts["failed"] += 1
            counts["streak"] += 1
            counts["infra_errors"] += result.infrastructure
        else:
            store.write(runner.label(result))
            counts["done"] += 1
            counts["streak"] = 0
        if on_progress:
            on_progress(counts["done"] + counts["failed"], len(jobs), counts["failed"])

    if on_progress:
        on_progress(0, len(jobs), 0)  # the total, known from the start
    own = pool is None
    envs = EnvPool(runner.make_env, min(concurrency, len(jobs))) if own else pool
    t0 = time.monotonic()
    try:
        await collect(
            envs, runner.policy, jobs, on_episode=finished,
            should_stop=lambda: abort_when_all_fail and counts["streak"] >= abort_after and counts["done"] == 0,
            lockstep=runner.lockstep,
        )
    finally:
        runner.close()
        if own:
            await envs.aclose()
    seconds = time.monotonic() - t0
    if abort_when_all_fail and counts["done"] == 0 and counts["failed"]:
        raise RuntimeError(f"every episode failed ({counts['failed']}); last error: {last_error[0]}")
    return JobCounts(counts["done"], counts["failed"], seconds, counts["infra_errors"], counts["infra_retries"])


def summarize_items(config: EvalConfig, items: list[tuple[str, dict[str, Any]]], trajectories: list[Trajectory]) -> dict[str, Any]:
    """Metrics over the finished samples ``0..n-1`` of ``items`` among ``trajectories``, in item order (so that
    every evaluation of the same episodes gives the same figures, whatever order they finished in)."""
    from agentrl.envs.registry import env_class

    wanted = {item_id for item_id, _ in items}
    grouped: dict[str, dict[int, Trajectory]] = defaultdict(dict)
    for t in trajectories:
        if t.task_id in wanted and isinstance(t.sample, int) and t.sample < config.n:
            grouped[t.task_id][t.sample] = t
    ordered = {i: [grouped[i][j] for j in sorted(grouped[i])] for i, _ in items if grouped.get(i)}
    cls = env_class(config.env)
    answer = (lambda t: comparable_answer(cls, t.final_answer)) if answers_comparable(cls) else None
    metrics = summarize(ordered, config.ks, answer=answer)
    metrics["env"], metrics["model"], metrics["api"] = config.env, config.model, config.api
    metrics["items_digest"] = items_digest(items)
    metrics["incomplete_items"] = len(wanted) - sum(1 for v in grouped.values() if len(v) == config.n)
    return metrics


class Evaluation:
    """One ``agentrl eval`` invocation. ``await run()`` returns the metrics dict (also in ``metrics.json``).

    ``on_progress(done, total, failed)`` is called after each episode. The episodes run with the runner that
    ``config.api`` and ``config.model`` give (:func:`~agentrl.evaluation.policies.open_runner`), in
    ``config.processes`` processes. (The trainer's held-out evaluations run the same jobs, :func:`eval_jobs` and
    :func:`run_jobs`, with its own engine's runner: :mod:`agentrl.train.heldout`.)
    """

    def __init__(
        self,
        config: EvalConfig,
        *,
        on_progress: Callable[[int, int, int], Any] | None = None,
        _child: bool = False,
    ):
        self.config = config
        self.on_progress = on_progress
        self.window = (0.0, 0.0)  # monotonic start/end of the episodes this process ran
        # the parent opens the directory in run(), once the tasks loaded: a failed start writes nothing
        self.store: ResultStore = ResultStore(config.out_dir(), config, write_config=False) if _child else None  # type: ignore[assignment]

    async def run(self) -> dict[str, Any]:
        cfg = self.config
        items = load_tasks(cfg)
        self.store = ResultStore(cfg.out_dir(), cfg)
        done = {(t.task_id, t.sample) for t in self.store.load(resuming=True)}
        todo = eval_jobs(cfg, items, done)
        t0 = time.perf_counter()
        try:
            if cfg.processes > 1 and len(todo) > 1:
                ran = await self._run_processes(todo)
            else:
                ran = await self._run_all(todo)
        finally:
            self.store.close()
        wall = time.perf_counter() - t0
        finished, failed, episodes_wall = ran.finished, ran.failed, ran.seconds
        metrics = summarize_items(cfg, items, self.store.load())
        metrics["run"] = {
            "episodes_run": finished,
            "episodes_failed": failed,
            "infra_errors": ran.infra_errors,
            "infra_retries": ran.infra_retries,
            "episodes_skipped": len(items) * cfg.n - len(todo),
            "wall_s": wall,
            "episodes_wall_s": episodes_wall,
            "episodes_per_s": finished / episodes_wall if episodes_wall > 0 and finished else 0.0,
            "unreadable_lines": self.store.unreadable,
        }
        self.store.write_metrics(metrics)
        return metrics

    async def _run_all(self, todo: list[EpisodeJob]) -> JobCounts:
        """Run ``todo`` (:func:`run_jobs`) with the runner :func:`open_runner` gives (and its engine, sandbox,
        HTTP client), open for the duration."""
        if not todo:
            return JobCounts()
        async with contextlib.AsyncExitStack() as stack:
            runner = await open_runner(self.config, stack)
            self.window = (time.monotonic(), 0.0)
            result = await run_jobs(runner, todo, self.store, concurrency=self.config.concurrency,
                                    on_progress=self.on_progress)
            self.window = (self.window[0], time.monotonic())
        return result

    async def _run_processes(self, todo: list[EpisodeJob]) -> JobCounts:
        """Split ``todo`` over ``processes`` child processes (each a client with its share of the
        concurrency), so Python's per-request CPU is spread over cores. Children append to the same
        files; the parent aggregates progress. Returns like :meth:`_run_all`."""
        cfg = self.config
        procs_n = min(cfg.processes, len(todo))
        child_cfg = replace(cfg, concurrency=math.ceil(cfg.concurrency / procs_n), processes=1)
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        procs = [
            ctx.Process(target=_child_main, args=(child_cfg, todo[k::procs_n], queue, k), daemon=True)
            for k in range(procs_n)
        ]
        for proc in procs:
            proc.start()
        progress = {k: (0, 0) for k in range(procs_n)}
        results: dict[int, tuple] = {}
        loop = asyncio.get_running_loop()
        try:
            while len(results) < procs_n:
                msg = await loop.run_in_executor(None, _get, queue, procs)
                if msg is None:
                    dead = [k for k, p in enumerate(procs) if not p.is_alive() and k not in results]
                    raise RuntimeError(f"eval worker process(es) {dead} died without reporting")
                kind, k, *rest = msg
                if kind == "progress":
                    progress[k] = tuple(rest)
                    if self.on_progress:
                        done = sum(d for d, _ in progress.values())
                        self.on_progress(done, len(todo), sum(f for _, f in progress.values()))
                elif kind == "error":
                    raise RuntimeError(f"eval worker process {k} failed: {rest[0]}")
                else:
                    results[k] = tuple(rest)
        finally:
            for proc in procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
        ran = [counts for counts, _, _ in results.values()]
        start = min(r[1] for r in results.values())
        end = max(r[2] for r in results.values())
        return JobCounts(sum(c.finished for c in ran), sum(c.failed for c in ran), end - start,
                         sum(c.infra_errors for c in ran), sum(c.infra_retries for c in ran))


def _get(queue: Any, procs: list[Any]) -> Any:
    """Next message from the children, or ``None`` once a child died silently."""
    import queue as queue_mod

    while True:
        try:
            return queue.get(timeout=1.0)
        except queue_mod.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                return None


def run_async(coro: Any) -> Any:
    """Run ``coro`` on uvloop when it is installed (it roughly halves the event loop's CPU per HTTP
    request, which bounds eval throughput at high concurrency), else on the default asyncio loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _child_main(cfg: EvalConfig, shard: list[EpisodeJob], queue: Any, k: int) -> None:
    """Entry point of one eval worker process: run ``shard`` and report counts and its time window."""

    def progress(done: int, total: int, failed: int) -> None:
        queue.put(("progress", k, done, failed))

    async def go() -> None:
        ev = Evaluation(cfg, on_progress=progress, _child=True)
        try:
            counts = await ev._run_all(shard)
        finally:
            ev.store.close()
        queue.put(("done", k, counts, *ev.window))

    try:
        run_async(go())
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        queue.put(("error", k, f"{type(exc).__name__}: {exc}"))

