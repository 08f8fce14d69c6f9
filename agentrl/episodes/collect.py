"""Many episodes at once over a pool of envs: the trainer's rollout and any batch collection.

Each episode is a coroutine running :func:`~agentrl.episodes.run_episode`. Episodes interleave on one
event loop: while a policy waits (an engine sampling a micro-batch in a worker thread, an HTTP request),
other episodes' tool calls run, and an episode whose tool returned joins the engine's next batch.

Failures never stop the collection and never lose data: an exception inside an episode (env bug, sandbox
crash, endpoint down) ends that episode; its partial trajectory is kept with ``error`` set (also the
trajectory's ``error``, with ``stop_reason="error"``), ``traceback`` the full traceback, ``usable`` is False,
and its env is replaced by a fresh one. With ``AGENTRL_DEBUG=1`` (:mod:`agentrl.errorlog`) the exception is
re-raised instead. An episode that a tool's backend ended (``stop_reason="infrastructure"``: not the model's
failure) is run again, up to ``infra_retries`` times; the result is the last run, with ``retries`` and
``retried_errors`` saying what happened before (a last run still ended so has ``error`` set and is not usable).
Each result's trajectory carries its job's labels (``task_id``, ``group``, ``sample``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agentrl import errorlog
from agentrl.envs.env import AgentEnv
from agentrl.episodes import runner
from agentrl.episodes.lockstep import LockstepSampler
from agentrl.episodes.policy import Policy
from agentrl.episodes.runner import INFRA_RETRIES, EpisodeLimits, EpisodeResult, StepHook, run_episode
from agentrl.harmony.trajectory import Trajectory

log = logging.getLogger(__name__)


class EnvPool:
    """A fixed set of env instances handed out one episode at a time (envs are reused across episodes).

    Envs are built lazily on first use (inside the running event loop). At most :attr:`in_flight` episodes run
    at once: ``size``, or fewer when the envs' tools admit fewer live sessions
    (:meth:`~agentrl.envs.AgentEnv.episode_capacity`, e.g. the local sandbox pool's ``max_sessions``; the tools are
    first asked to admit ``size``, which a local pool not yet started grants as far as its memory backs them), so
    that no episode waits for a tool session that only another episode in flight could free."""

    def __init__(self, make_env: Callable[[], AgentEnv], size: int) -> None:
        if size < 1:
            raise ValueError(f"env pool size must be >= 1, got {size}")
        self._make_env = make_env
        self._envs: list[AgentEnv] = []
        self._free: asyncio.Queue[AgentEnv] | None = None
        self.size = size
        #: Episodes in flight at most (known once :meth:`open` ran; ``size`` until then).
        self.in_flight = size

    async def open(self) -> int:
        """Build the envs (once) and return :attr:`in_flight`. A capacity query that fails (e.g. the sandbox
        cannot be set up) leaves ``size``: the episodes then meet the error themselves."""
        if self._free is None:
            first = self._make_env()
            try:
                capacity = await first.episode_capacity(self.size)
            except Exception as exc:  # noqa: BLE001 - the episodes report it, one by one
                log.warning("could not ask the envs' tools for their capacity (%s: %s)", type(exc).__name__, exc)
                capacity = None
            if capacity is not None and capacity < self.size:
                log.info("%d episodes in flight instead of %d: the envs' tools admit %d sessions", max(1, capacity),
                         self.size, capacity)
            self.in_flight = self.size if capacity is None else max(1, min(self.size, capacity))
            self._free = asyncio.Queue()
            self._envs.append(first)
            self._free.put_nowait(first)
            for _ in range(self.in_flight - 1):
                env = self._make_env()
                self._envs.append(env)
                self._free.put_nowait(env)
        return self.in_flight

    async def acquire(self) -> AgentEnv:
        if self._free is None:
            await self.open()
        assert self._free is not None
        return await self._free.get()

    def release(self, env: AgentEnv) -> None:
        assert self._free is not None, "release() of an env that was never acquired"
        self._free.put_nowait(env)

    def replace(self, env: AgentEnv) -> None:
        """Drop a broken env (closing it best-effort) and add a fresh one."""
        assert self._free is not None, "replace() of an env that was never acquired"
        try:
            env.close()
        except Exception:  # noqa: BLE001 - a broken env may fail to close; a new one replaces it anyway
            pass
        self._envs.remove(env)
        fresh = self._make_env()
        self._envs.append(fresh)
        self._free.put_nowait(fresh)

    async def aclose(self) -> None:
        for env in self._envs:
            await env.aclose()
        self._envs.clear()
        self._free = None


@dataclass(frozen=True)
class EpisodeJob:
    """One episode to run: ``task`` (``None``: the env draws one with ``seed``), the env's reset ``seed``,
    and labels copied to the result: ``task_id``, ``group`` (id shared by the samples of one task) and
    ``sample`` (which sample of its task this is)."""

    task: dict[str, Any] | None
    seed: int | None = None
    task_id: str | None = None
    group: int | None = None
    sample: int = 0


def grouped_jobs(tasks: Sequence[tuple[str, dict[str, Any]]], n: int, seed: int) -> list[EpisodeJob]:
    """``n`` jobs per ``(task_id, task)``, ordered by (task, sample); sample ``k`` of task ``g`` gets env
    seed ``seed + g*n + k`` and group ``g``."""
    return [
        EpisodeJob(task, seed + g * n + k, task_id, g, k)
        for g, (task_id, task) in enumerate(tasks)
        for k in range(n)
    ]


async def collect(
    pool: EnvPool,
    policy: Policy | Callable[[EpisodeJob], Policy],
    jobs: Sequence[EpisodeJob],
    *,
    limits: EpisodeLimits | None = None,
    on_step: StepHook | None = None,
    on_episode: Callable[[EpisodeResult], Any] | None = None,
    should_stop: Callable[[], bool] | None = None,
    lockstep: LockstepSampler | None = None,
    infra_retries: int = INFRA_RETRIES,
) -> list[EpisodeResult]:
    """Run every job concurrently (at most ``pool.in_flight`` at a time); returns the results in job order.

    Args:
        pool: the envs to run on.
        policy: one policy for all episodes, or a function ``job -> Policy`` (e.g. a per-sample seed).
        jobs: the episodes to run.
        limits, on_step: passed to :func:`~agentrl.episodes.run_episode`.
        on_episode: called with each result as it finishes (failed ones too), e.g. to write it out.
        should_stop: checked before each episode starts; once it returns True the jobs not yet started
            are skipped (e.g. every episode so far failed: the model is unreachable).
        lockstep: the :class:`~agentrl.episodes.lockstep.LockstepSampler` the policies sample through, if
            any: their engine calls are then batched in lockstep, in job order, so that the batches and the
            engine's random draws do not depend on timing (two runs of one seed are identical).
        infra_retries: how many times a job that a tool's backend ended is run again (on the same env, after
            ``k * INFRA_RETRY_DELAY_S`` seconds, with a fresh policy from ``policy(job)``).

    Returns:
        One :class:`~agentrl.episodes.EpisodeResult` per job that ran (skipped ones are left out; each
        result carries its job's labels); an episode that raised has ``error`` set,
        ``stop_reason="error"`` and its partial trajectory. Raises only what ``on_episode`` raises (and, under
        ``AGENTRL_DEBUG=1``, what an episode raises).
    """
    make_policy = policy if not hasattr(policy, "act") else (lambda job: policy)  # type: ignore[misc]

    async def one(index: int, job: EpisodeJob) -> EpisodeResult | None:
        if lockstep is None:
            return await episode(job)
        lockstep.enter(index)
        try:
            return await episode(job)
        finally:
            lockstep.finished()

    async def attempt(env: AgentEnv, job: EpisodeJob) -> EpisodeResult:
        previous = env.trajectory  # the last episode's, until this episode's reset replaces it
        try:
            return await run_episode(
                env, make_policy(job), task=job.task, seed=job.seed, limits=limits, on_step=on_step
            )
        except Exception as exc:  # noqa: BLE001 - one bad episode must not stop the others
            if errorlog.debug():
                raise
            error = f"{type(exc).__name__}: {exc}"
            started = env.trajectory is not None and env.trajectory is not previous
            partial = env.trajectory if started else Trajectory(prompt_ids=[])
            partial.error, partial.stop_reason = error, "error"
            return EpisodeResult(partial, "error", error=error, traceback=errorlog.format_exception(exc))

    async def episode(job: EpisodeJob) -> EpisodeResult | None:
        env = await pool.acquire()
        if should_stop is not None and should_stop():
            pool.release(env)
            return None
        retried: list[str] = []
        while True:
            result = await attempt(env, job)
            if result.stop_reason == "error":
                pool.replace(env)
                break
            if not result.infrastructure or len(retried) >= infra_retries:
                pool.release(env)
                break
            retried.append(f"{result.error}\n{result.traceback or ''}".rstrip())
            await asyncio.sleep(runner.INFRA_RETRY_DELAY_S * len(retried))
        result.retries, result.retried_errors = len(retried), retried
        result.task_id, result.group, result.sample = job.task_id, job.group, job.sample
        traj = result.trajectory
        traj.task_id, traj.sample = job.task_id, job.sample
        traj.group = None if job.group is None else str(job.group)
        if on_episode is not None:
            on_episode(result)
        return result

    in_flight = await pool.open()
    if lockstep is not None:
        lockstep.open(len(jobs), in_flight)
    try:
        results = await asyncio.gather(*(one(i, job) for i, job in enumerate(jobs)))
    finally:
        if lockstep is not None:
            lockstep.close()
    return [r for r in results if r is not None]
