"""The trainer's rollout: ``n`` episodes per task through the shared episode runner, with engine timings.

Episodes run concurrently over an :class:`~agentrl.episodes.EnvPool` (see :func:`agentrl.episodes.collect`),
each driven by a :class:`~agentrl.episodes.TokenPolicy` on the trainer's local engine. An episode that
raises is kept (``usable=False``, its partial trajectory saved and counted) and never stops training. One that a
tool's backend ended (``stop_reason="infrastructure"``: not the model's failure) is run again by
:func:`~agentrl.episodes.collect`, and left out of the update when it still fails (:func:`trainable`).

With an engine that has clients (:meth:`agentrl.engines.decode.decode_engine.DecodeEngine.client`), each
episode samples through its own client, keyed by its env seed (:class:`~agentrl.episodes.clients.EpisodeClients`),
so what it samples does not depend on which episodes shared its batches (and the engine's deterministic mode knows
when every episode has asked); the engine's memory is released after the rollout (:meth:`release`), before the
update needs it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agentrl.engines.base import SamplingParams
from agentrl.episodes import (
    EnvPool,
    EpisodeClients,
    EpisodeJob,
    EpisodeResult,
    LockstepSampler,
    TokenPolicy,
    collect,
    grouped_jobs,
    has_clients,
)
from agentrl.progress import ProgressLines


@dataclass
class RolloutResult:
    """``episodes`` ordered by (task, sample); ``wall_s`` the rollout's wall time; ``gen_s`` and
    ``generated_tokens`` the engine's sampling time and tokens during it."""

    episodes: list[EpisodeResult]
    wall_s: float
    gen_s: float
    generated_tokens: int


async def rollout(
    pool: EnvPool,
    engine: Any,
    sampling: SamplingParams,
    tasks: Sequence[tuple[str, dict[str, Any]]],
    n: int,
    seed: int,
    progress_interval_s: float = 0.0,
) -> RolloutResult:
    """Run ``n`` episodes per ``(task_id, task)`` with ``engine`` (which keeps ``stats["generate_s"]`` and
    ``stats["generated_tokens"]``); sample ``k`` of task ``g`` gets env seed ``seed + g*n + k``. The transformers
    engine's calls are batched in lockstep (:class:`~agentrl.episodes.LockstepSampler`), an engine with clients
    samples per episode (module docstring): either way what is sampled does not depend on timing. When stdout is
    not a terminal, a progress line every ``progress_interval_s`` seconds (:class:`~agentrl.progress.ProgressLines`)."""
    t0 = time.perf_counter()
    gen0, tok0 = engine.stats["generate_s"], engine.stats["generated_tokens"]
    jobs = grouped_jobs(tasks, n, seed)
    with ProgressLines("rollout", len(jobs), interval_s=progress_interval_s) as lines:
        finished = [0, 0]  # episodes, failed ones

        def count(result: EpisodeResult) -> None:
            finished[0] += 1
            finished[1] += result.error is not None
            lines.update(finished[0], failed=finished[1])

        if has_clients(engine):
            episodes = await _collect_through_clients(pool, engine, sampling, jobs, on_episode=count)
        else:  # the transformers engine: one policy for every episode, sampled in lockstep
            sampler = LockstepSampler(engine)
            episodes = await collect(pool, TokenPolicy(sampler, sampling), jobs, on_episode=count, lockstep=sampler)
    return RolloutResult(
        episodes=episodes,
        wall_s=time.perf_counter() - t0,
        gen_s=engine.stats["generate_s"] - gen0,
        generated_tokens=engine.stats["generated_tokens"] - tok0,
    )


async def _collect_through_clients(
    pool: EnvPool, engine: Any, sampling: SamplingParams, jobs: Sequence[EpisodeJob],
    on_episode: Callable[[EpisodeResult], Any] | None = None,
) -> list[EpisodeResult]:
    """:func:`collect` with one engine client per episode, keyed by its env seed (see the module docstring);
    the engine's memory is released afterwards. ``on_episode``: called with each result as it finishes."""
    clients = EpisodeClients(engine, lambda job: job.seed, lambda client, job: TokenPolicy(client, sampling))

    def finished(result: EpisodeResult) -> None:
        clients.finished(result)
        if on_episode is not None:
            on_episode(result)

    try:
        return await collect(pool, clients.policy, jobs, on_episode=finished)
    finally:
        clients.close()
        engine.release()


def trainable(episodes: Sequence[EpisodeResult]) -> list[bool]:
    """Which of a rollout's episodes the update trains on: the usable ones with model tokens (not one that
    raised, one a tool's backend ended, or one whose reward function raised), and of a task's samples (its
    group, when it has two or more) only while at least two of them are: a sample left alone would be its own
    baseline (GRPO gives a singleton group its raw score as advantage), so its group is dropped."""
    ok = [e.usable and sum(e.trajectory.response_mask) > 0 for e in episodes]
    size = Counter(e.group for e in episodes)
    kept = Counter(e.group for e, k in zip(episodes, ok, strict=True) if k)
    return [k and (size[e.group] < 2 or kept[e.group] >= 2) for e, k in zip(episodes, ok, strict=True)]
