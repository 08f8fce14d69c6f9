"""The episode as a policy and the hooks see it while it runs: the env, the task, and the steps so far."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentrl.envs.env import AgentEnv
from agentrl.harmony.trajectory import Trajectory, TurnRecord
from agentrl.harmony.types import Message


@dataclass
class Step:
    """One ``env.astep(action)`` and what it returned.

    ``observation``: ``{"tokens": ids the env appended, "messages": their parsed messages}``;
    ``reward``: the episode reward on the last step, else 0.0; ``info``: the env's info dict (the last
    step's carries ``stop_reason``, ``trajectory`` and ``reward_components``); ``turn``: the
    trajectory's record of this action (parsed messages, tool calls with results, token spans);
    ``env_s``: seconds spent in ``astep`` (parsing, tools, rendering, reward).
    """

    action: Any
    observation: dict[str, Any]
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]
    turn: TurnRecord
    env_s: float = 0.0

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated


@dataclass
class EpisodeState:
    """A running episode. The trajectory itself is the env's (``env.trajectory``): token-exact, with
    every model token, env token, log-prob and turn record.

    ``prompt_messages``: the messages of the rendered prompt (``reset``'s ``obs["messages"]``);
    ``steps``: every env step so far, in order; ``started``: ``time.perf_counter()`` at reset.
    """

    env: AgentEnv
    task: dict[str, Any]
    seed: int | None
    prompt_messages: Sequence[Message]
    steps: list[Step] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)

    @property
    def trajectory(self) -> Trajectory:
        traj = self.env.trajectory
        assert traj is not None, "the env has no episode (reset was not called)"
        return traj

    @property
    def context(self) -> list[int]:
        """The exact token stream the next action continues: prompt, then every model and env token."""
        traj = self.trajectory
        return [*traj.prompt_ids, *traj.response_ids]

    @property
    def tokens_left(self) -> int:
        """Tokens left under the env's ``max_total_tokens`` (prompt + response)."""
        traj = self.trajectory
        return self.env.limits.max_total_tokens - len(traj.prompt_ids) - len(traj.response_ids)
