"""Rollout collection: many episodes at once over a pool of envs and one (micro-batching) engine.

Each episode is a coroutine: ``areset`` -> loop { ``engine.generate`` on the exact token stream so far
-> ``astep(completion)`` } until terminated/truncated. Episodes interleave on one event loop: while the
engine samples a batch (in a worker thread), other episodes' tool calls run, and an episode whose tool
returned joins the engine's next batch.

Failures never stop the trainer and never lose data: an exception inside an episode (env bug, sandbox
crash) ends that episode; its partial trajectory is kept with ``metadata["rollout_error"]`` and
``usable=False`` (it is saved and counted, but not trained on).
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentrl.engines.base import SamplingParams
from agentrl.harmony.trajectory import Trajectory


@dataclass
class Episode:
    """One finished (or failed) episode. ``group``: id shared by the samples of one task.
    ``usable``: False when the episode raised (``error`` holds the traceback's last line)."""

    trajectory: Trajectory
    group: int
    task_id: str
    usable: bool = True
    error: str | None = None
    tool_s: float = 0.0
    env_s: float = 0.0
    routing: Any = None  # [L, n, k] experts of the last completion's forward (routing replay), or None


@dataclass
class RolloutResult:
    episodes: list[Episode]
    wall_s: float
    gen_s: float
    generated_tokens: int
    meta: dict[str, Any] = field(default_factory=dict)


class EnvPool:
    """A fixed set of env instances handed out one episode at a time (envs are reused across steps)."""

    def __init__(self, make_env: Callable[[], Any], size: int) -> None:
        if size < 1:
            raise ValueError(f"env pool size must be >= 1, got {size}")
        self._make_env = make_env
        self._envs: list[Any] = []
        self._free: asyncio.Queue | None = None
        self.size = size

    def _ensure(self) -> asyncio.Queue:
        if self._free is None:
            self._free = asyncio.Queue()
            for _ in range(self.size):
                env = self._make_env()
                self._envs.append(env)
                self._free.put_nowait(env)
        return self._free

    async def acquire(self) -> Any:
        return await self._ensure().get()

    def release(self, env: Any) -> None:
        self._ensure().put_nowait(env)

    def replace(self, env: Any) -> None:
        """Drop a broken env (closing it best-effort) and add a fresh one."""
        try:
            env.close()
        except Exception:  # noqa: BLE001 - a broken env may fail to close; a new one replaces it anyway
            pass
        self._envs.remove(env)
        fresh = self._make_env()
        self._envs.append(fresh)
        self._ensure().put_nowait(fresh)

    async def aclose(self) -> None:
        for env in self._envs:
            await env.aclose()
        self._envs.clear()
        self._free = None


async def run_episode(
    env: Any, engine: Any, sampling: SamplingParams, task: dict[str, Any], seed: int
) -> tuple[Trajectory, float, Any]:
    """Drive one episode to its end; returns ``(trajectory, seconds spent in env.astep, routing)`` where
    ``routing`` is the last completion's recorded MoE routing (it covers the whole context that the
    last action was sampled from) or None. In a multi-turn episode the tokens of earlier turns are
    thus replayed with the routing the last turn's prefill computed for them, which can differ from
    the routing they were sampled under (each turn re-runs the context; there is no cross-turn cache)."""
    obs, _ = await env.areset(seed=seed, options={"task": task})
    env_s = 0.0
    while True:
        traj = env.trajectory
        context = list(traj.prompt_ids) + list(traj.response_ids)
        (completion,) = await engine.generate([context], sampling)
        t0 = time.perf_counter()
        obs, _, terminated, truncated, _ = await env.astep(completion)
        env_s += time.perf_counter() - t0
        if terminated or truncated:
            return env.trajectory, env_s, completion.routing


async def collect(
    pool: EnvPool,
    engine: Any,
    sampling: SamplingParams,
    tasks: Sequence[tuple[str, dict[str, Any]]],
    n: int,
    seed: int,
) -> RolloutResult:
    """Run ``n`` episodes per ``(task_id, task)``; episode ``k`` of task ``g`` gets env seed
    ``seed + g*n + k``. Returns episodes ordered by (task, sample)."""
    t0 = time.perf_counter()
    gen0, tok0 = engine.stats["generate_s"], engine.stats["generated_tokens"]

    async def one(group: int, k: int, task_id: str, task: dict[str, Any]) -> Episode:
        env = await pool.acquire()
        try:
            traj, env_s, routing = await run_episode(env, engine, sampling, task, seed + group * n + k)
        except Exception as exc:  # noqa: BLE001 - one bad episode must not stop training
            partial = env.trajectory or Trajectory(prompt_ids=[])
            partial.metadata["rollout_error"] = traceback.format_exception_only(type(exc), exc)[-1].strip()
            pool.replace(env)
            return Episode(partial, group, task_id, usable=False, error=partial.metadata["rollout_error"])
        pool.release(env)
        tool_s = sum(rec.latency_s for turn in traj.turns for rec in turn.tools)
        return Episode(traj, group, task_id, tool_s=tool_s, env_s=env_s, routing=routing)

    jobs = [one(g, k, tid, task) for g, (tid, task) in enumerate(tasks) for k in range(n)]
    episodes = await asyncio.gather(*jobs)
    return RolloutResult(
        episodes=list(episodes),
        wall_s=time.perf_counter() - t0,
        gen_s=engine.stats["generate_s"] - gen0,
        generated_tokens=engine.stats["generated_tokens"] - tok0,
    )
