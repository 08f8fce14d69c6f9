"""Lockstep batching (:class:`agentrl.episodes.LockstepSampler`): the engine's batches of a collection, and their
rows' order, are the same whatever the timing of the episodes' tools, also when more jobs than envs queue for
the pool and when episodes fail; without it they follow the timing."""

from __future__ import annotations

import asyncio
import random

from _scripted_engine import ScriptedEngine
from test_episodes import FMT, ParityEnv, script

from agentrl.engines.base import SamplingParams
from agentrl.episodes import EnvPool, EpisodeJob, LockstepSampler, TokenPolicy, collect


class Recording:
    """The scripted engine, recording each engine call's prompts (a batch)."""

    def __init__(self) -> None:
        self.inner = ScriptedEngine(FMT, script)
        self.batches: list[tuple[tuple[int, ...], ...]] = []

    async def generate(self, prompts, sampling):
        self.batches.append(tuple(tuple(p) for p in prompts))
        await asyncio.sleep(0.001)
        return await self.inner.generate(prompts, sampling)


class Jittery:
    """A policy whose env and tool time before each action is random (``rng``); ``fail``: task ids whose episode
    raises before its second action."""

    def __init__(self, inner, rng: random.Random, fail: set[str]) -> None:
        self.inner, self.rng, self.fail = inner, rng, fail

    async def act(self, episode):
        await asyncio.sleep(self.rng.random() * 0.02)
        if episode.task["id"] in self.fail and len(episode.trajectory.turns) > 0:
            raise RuntimeError("the sandbox died")
        return await self.inner.act(episode)


JOBS = [EpisodeJob({"id": str(i), "prompt": f"{kind}: {i} and {i + 1}", "answer": str(2 * i + 1)}, i, str(i), i)
        for i, kind in enumerate(["add", "ghost", "loop", "add", "loop", "ghost", "add", "add", "loop", "ghost"])]


async def _collect(delays: int, *, lockstep: bool, pool_size: int = 4, fail: frozenset = frozenset({"4"})):
    engine = Recording()
    sampler = LockstepSampler(engine) if lockstep else None
    inner = TokenPolicy(sampler or engine, SamplingParams(max_new_tokens=256))
    pool = EnvPool(lambda: ParityEnv(format=FMT, max_turns=3), pool_size)
    results = await collect(pool, Jittery(inner, random.Random(delays), set(fail)), JOBS, lockstep=sampler)
    await pool.aclose()
    return engine.batches, results


async def test_the_batches_do_not_depend_on_timing():
    batches, results = await _collect(0, lockstep=True)
    assert [r.task_id for r in results] == [j.task_id for j in JOBS]
    assert [r.error is not None for r in results] == [j.task_id == "4" for j in JOBS]
    assert len(batches[0]) == 4  # the pool's four first jobs, together
    assert sum(len(b) for b in batches) == sum(len(r.trajectory.turns) for r in results)
    for delays in (1, 2, 3):
        again, _ = await _collect(delays, lockstep=True)
        assert again == batches


async def test_without_lockstep_the_batches_follow_the_timing():
    # the same episodes, sampled as their tools return: the engine's calls change with the timing (this is
    # what lockstep removes; the test above would notice)
    seen = {tuple((await _collect(delays, lockstep=False))[0]) for delays in range(4)}
    assert len(seen) > 1


async def test_one_env_runs_the_jobs_one_at_a_time_and_calls_outside_a_collection_pass_through():
    batches, results = await _collect(5, lockstep=True, pool_size=1, fail=frozenset())
    assert all(len(b) == 1 for b in batches) and all(r.usable for r in results)
    class Echo:
        async def generate(self, prompts, sampling):
            return [list(p) for p in prompts]

    assert await LockstepSampler(Echo()).generate([[1, 2]], None) == [[1, 2]]  # no collection: straight through
