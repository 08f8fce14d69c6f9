"""Engine calls of many episodes batched in lockstep: batches and random draws that do not depend on timing.

A local engine batches the requests waiting when it starts a batch (e.g. :class:`agentrl.engines.
transformers_engine.TransformersEngine`). Which episodes share a batch, the order in which its rows draw from
the engine's random generator and, through padding and batch shape, the last bits of their logits then depend
on when each episode's tool call returned: two runs of one seed differ.

:class:`LockstepSampler` wraps such an engine for :func:`~agentrl.episodes.collect` (``collect(...,
lockstep=sampler)`` with policies that call the sampler, e.g. ``TokenPolicy(sampler, sampling)``). An
episode's call waits until every episode of the collection that is running or about to start has made its
call or finished (episodes running tools are waited for); then the waiting calls go to the engine together,
ordered by job index, one engine call per sampling setting in the order of their first job (when that call
raises, each job's call is made alone, in order: a request the engine refuses fails its own episode). Which episodes
are running at that point is fixed too: ``pool.in_flight`` episodes run at once and jobs take free envs in job
order, so once ``f`` jobs have finished, jobs ``0 .. f + pool.in_flight - 1`` have started or are about to. The
batches, their rows' order and the engine's draws are a function of the jobs, the engine's seed and
``pool.in_flight`` alone (the pool's size, or less when the envs' tools admit fewer sessions even when asked for
that many, e.g. a local sandbox pool, whose capacity follows the machine's cores and memory).

What lockstep cannot make independent of the machine's speed: an episode wall-time limit (``EpisodeLimits.time_s``,
none by default; waiting for the batch counts), and a tool's own wall-clock limit for code that runs close to it
(e.g. retool's ``exec_timeout_s``).

A call made outside a lockstep collection (no job of an open collection in its task's context) goes to the
engine directly. Imports no torch.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Sequence
from typing import Any

__all__ = ["LockstepSampler"]

_JOB: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("agentrl_lockstep_job", default=None)


class LockstepSampler:
    """Batches the engine calls of one collection's episodes in lockstep (module docstring). ``engine``: any
    object with ``async generate(prompts, sampling) -> completions`` (one per prompt, in order)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._collection = 0  # id of the open collection (0: none)
        self._opened = 0  # collections opened so far (ids are never reused)
        self._remaining = 0  # jobs of the open collection not finished yet
        self._capacity = 0  # episodes running at once (the pool's size)
        self._pending: dict[int, tuple[list[list[int]], Any, asyncio.Future]] = {}
        self._batch: asyncio.Task | None = None

    # ------------------------------------------------------------------ collect's side
    def open(self, jobs: int, capacity: int) -> None:
        """A collection of ``jobs`` episodes, ``capacity`` at a time, starts."""
        if self._collection:
            raise RuntimeError("a LockstepSampler serves one collection at a time")
        self._opened += 1
        self._collection = self._opened
        self._remaining, self._capacity = jobs, capacity

    def enter(self, index: int) -> None:
        """The calling task runs job ``index`` of the open collection (its engine calls are batched)."""
        _JOB.set((self._collection, index))

    def finished(self) -> None:
        """A job of the open collection ended (or was skipped)."""
        self._remaining -= 1
        self._release()

    def close(self) -> None:
        """The collection is over."""
        self._collection, self._remaining = 0, 0
        for _, _, future in self._pending.values():
            if not future.done():
                future.set_exception(RuntimeError("the collection ended while an engine call was waiting"))
        self._pending.clear()

    # ------------------------------------------------------------------ the policies' side
    async def generate(self, prompts: Sequence[Sequence[int]], sampling: Any) -> Any:
        """The engine's completions of ``prompts``, sampled in the collection's next lockstep batch."""
        job = _JOB.get()
        if not self._collection or job is None or job[0] != self._collection:
            return await self.engine.generate(prompts, sampling)
        index = job[1]
        if index in self._pending:
            raise RuntimeError(f"job {index} made a second engine call while its first was waiting")
        future = asyncio.get_running_loop().create_future()
        self._pending[index] = ([list(p) for p in prompts], sampling, future)
        self._release()
        return await future

    def _release(self) -> None:
        """Send the waiting calls to the engine once every running or starting episode has made one."""
        expected = min(self._capacity, self._remaining)
        if self._batch is not None or not self._pending or len(self._pending) < expected:
            return
        calls = [self._pending.pop(i) for i in sorted(self._pending)]
        self._batch = asyncio.get_running_loop().create_task(self._sample(calls))

    async def _sample(self, calls: list[tuple[list[list[int]], Any, asyncio.Future]]) -> None:
        try:
            groups: list[tuple[Any, list[tuple[list[list[int]], Any, asyncio.Future]]]] = []
            for call in calls:  # one engine call per sampling setting, in the order of their first job
                group = next((g for s, g in groups if s == call[1]), None)
                if group is None:
                    groups.append((call[1], [call]))
                else:
                    group.append(call)
            for sampling, group in groups:
                await self._sample_group(sampling, group)
        finally:
            self._batch = None
        self._release()

    async def _sample_group(self, sampling: Any, group: list[tuple[list[list[int]], Any, asyncio.Future]]) -> None:
        """One engine call for the group; if it raises, each call of the group alone, in order, so that a
        request the engine refuses fails its own episode only."""
        try:
            completions = await self.engine.generate([p for prompts, _, _ in group for p in prompts], sampling)
        except Exception as exc:  # noqa: BLE001 - retried call by call below, or delivered to its episode
            if len(group) == 1:
                _deliver(group[0][2], error=exc)
                return
            for call in group:
                await self._sample_group(sampling, [call])
            return
        offset = 0
        for prompts, _, future in group:
            _deliver(future, result=list(completions[offset : offset + len(prompts)]))
            offset += len(prompts)


def _deliver(future: asyncio.Future, *, result: Any = None, error: BaseException | None = None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
