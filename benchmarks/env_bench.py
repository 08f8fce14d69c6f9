"""Env overhead benchmark: many concurrent retool episodes, a scripted policy and an instant code tool.

Each episode runs 3 steps on the real HarmonyFormat: two ``python`` calls (answered by an in-process sandbox
backend that returns at once, so tool time is ~0 and is measured and subtracted anyway) and a final answer.
Policy time is excluded: the policy's token ids are rendered before timing starts.

    .venv/bin/python benchmarks/env_bench.py [--episodes 256] [--rounds 4]

Last line: ``env: step_overhead_us=<n> episodes_per_s=<n>``; step overhead = (process CPU time - reset CPU
time - tool time) / steps: parsing, dispatch, observation rendering and the final reward, with all episodes
interleaved. ``episodes_per_s`` is wall-clock (resets included), so it drops when the machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import numpy as np

from agentrl.envs.builtin.retool import ReToolEnv
from agentrl.envs.sandbox.base import ExecResult
from agentrl.harmony import default_format
from agentrl.harmony.types import Message


class InstantSandbox:
    """A SandboxBackend that answers every run at once with a fixed output (no code is executed)."""

    def __init__(self) -> None:
        self.tool_s = 0.0
        self._n = 0

    async def run(
        self, code: str, *, session: str | None = None, timeout_s: float = 10.0, stdin: str = ""
    ) -> ExecResult:
        t = time.perf_counter()
        res = ExecResult(stdout="42\n", stderr="", exit_code=0, status="ok", duration_s=0.0)
        self.tool_s += time.perf_counter() - t
        return res

    async def create_session(self) -> str:
        self._n += 1
        return f"s{self._n}"

    async def release_session(self, session: str) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def __aenter__(self) -> InstantSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None


async def main(episodes: int, rounds: int) -> None:
    fmt = default_format()
    sandbox = InstantSandbox()
    envs = [ReToolEnv(sandbox=sandbox, format=fmt) for _ in range(episodes)]
    tasks = ReToolEnv.tasks(n=episodes, seed=0)
    scripts = [
        [
            fmt.render_completion(
                [Message("assistant", "x = 6 * 7", channel="analysis", recipient="python")]
            ),
            fmt.render_completion([Message("assistant", "print(x)", channel="analysis", recipient="python")]),
            fmt.render_completion(
                [
                    Message("assistant", "Done.", channel="analysis"),
                    Message("assistant", f"\\boxed{{{t['answer']}}}", channel="final"),
                ]
            ),
        ]
        for t in tasks
    ]
    step_s: list[float] = []
    reset_s: list[float] = []
    rewards: list[float] = []

    async def episode(env: ReToolEnv, task: dict, script: list[list[int]]) -> None:
        t = time.process_time()
        await env.areset(options={"task": task})  # never suspends: timed alone
        reset_s.append(time.process_time() - t)
        for ids in script:
            t = time.perf_counter()
            _, r, term, trunc, _ = await env.astep(ids)
            step_s.append(time.perf_counter() - t)
            if term or trunc:
                rewards.append(r)
                break

    async def one_round() -> None:
        await asyncio.gather(*(episode(e, t, s) for e, t, s in zip(envs, tasks, scripts, strict=True)))

    await one_round()  # warm-up
    for samples in (step_s, reset_s, rewards):
        samples.clear()
    sandbox.tool_s = 0.0
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(rounds):
        await one_round()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    for e in envs:
        await e.aclose()
    n_eps = episodes * rounds
    assert len(rewards) == n_eps and all(r == 1.0 for r in rewards), "scripted episodes must all succeed"
    # One thread runs everything and the tool never waits, so the process's CPU time is the resets plus the
    # steps (CPU time, not wall time, so that other processes on a shared machine do not count); per-step
    # timers would also count other episodes' work whenever a step yields to the loop.
    overhead_us = (cpu - sum(reset_s) - sandbox.tool_s) / len(step_s) * 1e6
    print(f"episodes={n_eps} concurrent={episodes} steps={len(step_s)} wall_s={wall:.3f} cpu_s={cpu:.3f}")
    print(
        f"reset_cpu_us median={statistics.median(reset_s) * 1e6:.0f}  step_wall_us median={statistics.median(step_s) * 1e6:.0f} "
        f"p99={np.percentile(step_s, 99) * 1e6:.0f}  tool_s_total={sandbox.tool_s:.4f}"
    )
    print(f"env: step_overhead_us={overhead_us:.0f} episodes_per_s={n_eps / wall:.0f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=256, help="concurrent episodes per round")
    ap.add_argument("--rounds", type=int, default=4, help="timed rounds (after one warm-up round)")
    a = ap.parse_args()
    asyncio.run(main(a.episodes, a.rounds))
