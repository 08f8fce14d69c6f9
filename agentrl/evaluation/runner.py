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
import json
import math
import multiprocessing
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from agentrl.episodes import EnvPool, EpisodeJob, EpisodeResult, collect
from agentrl.evaluation.answers import answers_comparable, comparable_answer
from agentrl.evaluation.config import EvalConfig, load_tasks
from agentrl.evaluation.metrics import summarize
from agentrl.evaluation.policies import open_runner
from agentrl.evaluation.store import ResultStore, items_digest
from agentrl.harmony.trajectory import Trajectory

__all__ = ["Evaluation", "run_async"]


class Evaluation:
    """One ``agentrl eval`` invocation. ``await run()`` returns the metrics dict (also in ``metrics.json``).

    ``on_progress(done, total, failed)`` is called after each episode.
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
        done = {(t.metadata.get("item_id"), t.metadata.get("sample")) for t in self.store.load()}
        todo = [
            (item_id, task, j) for item_id, task in items for j in range(cfg.n) if (item_id, j) not in done
        ]
        t0 = time.perf_counter()
        if cfg.processes > 1 and len(todo) > 1:
            finished, failed, episodes_wall = await self._run_processes(todo)
        else:
            finished, failed, episodes_wall = await self._run_all(todo)
        wall = time.perf_counter() - t0
        self.store.close()
        metrics = self.summary(items)
        metrics["run"] = {
            "episodes_run": finished,
            "episodes_failed": failed,
            "episodes_skipped": len(items) * cfg.n - len(todo),
            "wall_s": wall,
            "episodes_wall_s": episodes_wall,
            "episodes_per_s": finished / episodes_wall if episodes_wall > 0 and finished else 0.0,
            "unreadable_lines": self.store.unreadable,
        }
        (self.store.out / "metrics.json").write_text(json.dumps(metrics, indent=1))
        return metrics

    def summary(self, items: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
        """Metrics over the finished samples ``0..n-1`` of the configured items."""
        wanted = {item_id for item_id, _ in items}
        grouped: dict[str, dict[int, Trajectory]] = defaultdict(dict)
        for t in self.store.load():
            item, sample = t.metadata.get("item_id"), t.metadata.get("sample")
            if item in wanted and isinstance(sample, int) and sample < self.config.n:
                grouped[item][sample] = t
        metrics = summarize({k: list(v.values()) for k, v in grouped.items()}, self.config.ks)
        metrics["env"], metrics["model"], metrics["api"] = self.config.env, self.config.model, self.config.api
        metrics["items_digest"] = items_digest(items)
        metrics["incomplete_items"] = len(wanted) - sum(
            1 for v in grouped.values() if len(v) == self.config.n
        )
        return metrics

    async def _run_all(self, todo: list[tuple[str, dict[str, Any], int]]) -> tuple[int, int, float]:
        """Run ``todo`` over a pool of ``concurrency`` envs (:func:`agentrl.episodes.collect`), writing
        each episode as it finishes; returns ``(finished, failed, seconds)`` where the seconds count from
        the first episode's start (after engine/sandbox setup) to the last one's end."""
        cfg = self.config
        if not todo:
            return 0, 0, 0.0
        counts = {"done": 0, "failed": 0, "streak": 0}
        # this many consecutive failures with no success means the model is unreachable: stop
        abort_after = 2 * cfg.concurrency + 2
        async with contextlib.AsyncExitStack() as stack:
            runner = await open_runner(cfg, stack)
            pool = EnvPool(runner.make_env, min(cfg.concurrency, len(todo)))
            stack.push_async_callback(pool.aclose)

            def finished(result: EpisodeResult) -> None:
                if result.error is not None:  # recorded, retried on the next run
                    self.store.write_error(str(result.task_id), result.sample, result.error)
                    counts["failed"] += 1
                    counts["streak"] += 1
                else:
                    traj = result.trajectory
                    traj.metadata.update(runner.describe(result))
                    traj.metadata.update(
                        item_id=result.task_id,
                        sample=result.sample,
                        env_name=cfg.env,
                        model=cfg.model,
                        latency_s=result.wall_s,
                        correct=bool(traj.reward_components.get("correct", traj.reward >= 1.0)),
                    )
                    if answers_comparable(runner.cls):  # present (even None) = maj@k is reported
                        traj.metadata["answer"] = comparable_answer(runner.cls, traj.final_answer)
                    self.store.write(traj)
                    counts["done"] += 1
                    counts["streak"] = 0
                if self.on_progress:
                    self.on_progress(counts["done"] + counts["failed"], len(todo), counts["failed"])

            jobs = [EpisodeJob(task, cfg.seed + j, item_id, sample=j) for item_id, task, j in todo]
            self.window = (time.monotonic(), 0.0)
            await collect(
                pool, runner.policy, jobs, on_episode=finished,
                should_stop=lambda: counts["streak"] >= abort_after and counts["done"] == 0,
            )
            self.window = (self.window[0], time.monotonic())
            seconds = self.window[1] - self.window[0]
        if counts["done"] == 0 and counts["failed"]:
            last = self.store.error_path.read_text().strip().splitlines()[-1]
            raise RuntimeError(
                f"every episode failed ({counts['failed']}); last error: {json.loads(last)['error']}"
            )
        return counts["done"], counts["failed"], seconds

    async def _run_processes(self, todo: list[tuple[str, dict[str, Any], int]]) -> tuple[int, int, float]:
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
        finished = sum(r[0] for r in results.values())
        failed = sum(r[1] for r in results.values())
        start = min(r[2] for r in results.values())
        end = max(r[3] for r in results.values())
        return finished, failed, end - start


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


def _child_main(cfg: EvalConfig, shard: list[tuple[str, dict[str, Any], int]], queue: Any, k: int) -> None:
    """Entry point of one eval worker process: run ``shard`` and report counts and its time window."""

    def progress(done: int, total: int, failed: int) -> None:
        queue.put(("progress", k, done, failed))

    async def go() -> None:
        ev = Evaluation(cfg, on_progress=progress, _child=True)
        try:
            done, failed, _ = await ev._run_all(shard)
        finally:
            ev.store.close()
        queue.put(("done", k, done, failed, *ev.window))

    try:
        run_async(go())
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        queue.put(("error", k, f"{type(exc).__name__}: {exc}"))

