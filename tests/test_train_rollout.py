"""Rollout collection: episodes run concurrently (tools of different episodes overlap), tool errors are
recorded, and an episode that raises is kept (marked unusable) without stopping the others."""

from __future__ import annotations

import asyncio

from agentrl.engines.base import Completion, SamplingParams
from agentrl.envs.env import AgentEnv, encode_action_text
from agentrl.envs.tools.function import tool
from agentrl.episodes import EnvPool
from agentrl.harmony import HarmonyFormat
from agentrl.train.metrics import episode_metrics
from agentrl.train.rollout import rollout

FMT = HarmonyFormat()


class MeetEnv(AgentEnv):
    """The model meets at a barrier through a tool, then answers; tasks pick what the model does."""

    barrier: asyncio.Barrier | None = None

    def make_tools(self):
        @tool
        async def meet() -> str:
            """Wait until another episode also calls meet."""
            await asyncio.wait_for(MeetEnv.barrier.wait(), timeout=60)
            return "met"

        @tool
        def explode() -> str:
            """Always fails."""
            raise RuntimeError("kaboom")

        return [meet, explode]

    def reward(self, ctx):
        return float(ctx.final == "done"), {}


CALL = "<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{{}}<|call|>"
FINAL = "<|channel|>final<|message|>done<|return|>"


class ScriptedEngine:
    """Answers from the task: first action calls ``task['tool']`` (if any), then a final answer."""

    def __init__(self):
        self.stats = {"generate_s": 0.0, "generated_tokens": 0, "batches": 0}

    async def generate(self, prompts, sampling):
        out = []
        for prompt in prompts:
            text = FINAL if FMT.decode(prompt).count("<|call|>") else None
            tool_name = next(v for k, v in _TASKS.items() if tuple(prompt[: len(k)]) == k)
            if tool_name == "raise":
                raise RuntimeError("engine failure")
            if text is None:
                text = CALL.format(name=tool_name) if tool_name else FINAL
            ids = encode_action_text(FMT, text)
            out.append(Completion(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop"))
            self.stats["generated_tokens"] += len(ids)
        await asyncio.sleep(0)
        return out


_TASKS: dict[tuple, str | None] = {}


def test_collect_overlaps_tools_and_survives_failures():
    tasks = [("meet-a", {"prompt": "a", "answer": "x", "tool": "meet"}),
             ("meet-b", {"prompt": "b", "answer": "x", "tool": "meet"}),
             ("explode", {"prompt": "c", "answer": "x", "tool": "explode"}),
             ("raise", {"prompt": "d", "answer": "x", "tool": "raise"})]

    async def main():
        MeetEnv.barrier = asyncio.Barrier(2)  # passes only if both meet calls are in flight together
        pool = EnvPool(lambda: MeetEnv(format=FMT), size=4)
        for _, task in tasks:  # map each task's rendered prompt to its script
            env = MeetEnv(format=FMT)
            obs, _ = await env.areset(options={"task": task})
            _TASKS[tuple(int(t) for t in obs["tokens"])] = task["tool"]
            await env.aclose()
        try:
            return await rollout(pool, ScriptedEngine(), SamplingParams(), tasks, n=1, seed=0)
        finally:
            await pool.aclose()

    result = asyncio.run(main())
    by_id = {e.task_id: e for e in result.episodes}
    assert [e.task_id for e in result.episodes] == ["meet-a", "meet-b", "explode", "raise"]
    for name in ("meet-a", "meet-b"):
        assert by_id[name].usable and by_id[name].trajectory.reward == 1.0
        assert by_id[name].trajectory.turns[0].tools[0].result == "met"
    boom = by_id["explode"]
    assert boom.usable and boom.trajectory.turns[0].tools[0].error is not None
    assert boom.trajectory.reward == 1.0  # the model read the error and still answered
    failed = by_id["raise"]
    assert not failed.usable and "engine failure" in failed.error
    assert failed.trajectory.error == failed.error
    m = episode_metrics(result.episodes)
    assert m["episode/rollout_errors"] == 1.0 and m["episode/tool_error_rate"] == 1 / 3
