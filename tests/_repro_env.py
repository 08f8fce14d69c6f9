"""An env on which a random tiny model trains for real: rewards vary within groups and tools are called.

A random model never writes a well-formed tool call, so :class:`ToolParityEnv` reads the first action of an
episode as a call of its ``count`` tool whenever the action's first sampled token id is odd (the call goes
through the env's real tool dispatch, and its result comes back as an observation for the second action).
Reward: 0.5 for a tool call plus 0.5 when the last action's first token id is even; so groups get varied
rewards and the policy update takes real optimizer steps. Used by ``tests/test_train_repro.py`` as
``env=tests/_repro_env.py:ToolParityEnv``."""

from __future__ import annotations

import json

from agentrl.envs import AgentEnv, EnvLimits, tool
from agentrl.harmony import ParsedTurn, ToolCall


@tool
def count(n: int) -> int:
    """Count to n and say how far it got.

    Args:
        n: how far to count
    """
    return sum(1 for _ in range(n))


class ToolParityEnv(AgentEnv):
    """Two actions; an odd first token id of the first action is a ``count`` call (see the module docstring)."""

    default_limits = EnvLimits(max_turns=2)

    def make_tools(self):
        return [count]

    @classmethod
    def generate_task(cls, rng, split="train"):
        n = int(rng.integers(10**6))
        return {"id": str(n), "prompt": f"Count something about {n}.", "answer": "0"}

    def _parse(self, ids):
        parsed = super()._parse(ids)
        first_action = self.trajectory is not None and not self.trajectory.turns
        if ids and ids[0] % 2 and first_action and not parsed.tool_calls:
            args = {"n": len(ids)}
            call = ToolCall(recipient="functions.count", name="count", arguments=args, raw_arguments=json.dumps(args))
            return ParsedTurn(messages=parsed.messages, tool_calls=[call], stop_token=parsed.stop_token)
        return parsed

    def reward(self, ctx):
        traj = ctx.trajectory
        called = float(any(turn.tools for turn in traj.turns))
        last = traj.response_ids[traj.turns[-1].model_span[0]] if traj.turns else 1
        return 0.5 * called + 0.5 * float(last % 2 == 0), {"tool_called": called}
