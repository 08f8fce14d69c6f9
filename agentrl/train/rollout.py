"""The trainer's rollout: ``n`` episodes per task through the shared episode runner, with engine timings.

Episodes run concurrently over an :class:`~agentrl.episodes.EnvPool` (see :func:`agentrl.episodes.collect`),
each driven by a :class:`~agentrl.episodes.TokenPolicy` on the trainer's local engine. An episode that
raises is kept (``usable=False``, its partial trajectory saved and counted) and never stops training.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentrl.engines.base import SamplingParams
from agentrl.episodes import EnvPool, EpisodeResult, TokenPolicy, collect, grouped_jobs
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
    ``stats["generated_tokens"]``); sample ``k`` of task ``g`` gets env seed ``seed + g*n + k``. When stdout is
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

        episodes = await collect(pool, TokenPolicy(engine, sampling), jobs, on_episode=count)
    return RolloutResult(
        episodes=episodes,
        wall_s=time.perf_counter() - t0,
        gen_s=engine.stats["generate_s"] - gen0,
        generated_tokens=engine.stats["generated_tokens"] - tok0,
    )
