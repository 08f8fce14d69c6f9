"""Token-in-token-out trajectories: the exact token stream a model emitted plus the env's tokens.

The fields mirror verl's ``AgentLoopOutput`` (prompt_ids, response_ids, response_mask,
response_logprobs, reward, num_turns, metrics) so the verl adapter stays thin.

Invariants (checked by :meth:`Trajectory.validate`):
- ``len(response_ids) == len(response_mask) == len(rollout_logprobs)``;
- ``response_mask[i] == 1`` exactly for tokens the model sampled; env tokens have mask 0 and
  log-prob 0.0;
- tokens are never re-tokenised: ``prompt_ids + response_ids`` is the stream the model conditioned on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from agentrl.harmony.types import ParsedTurn


@dataclass
class ToolRecord:
    """One tool invocation as it happened: what was asked, what came back, how long, which error."""

    name: str
    arguments: Any
    result: str
    latency_s: float = 0.0
    error: str | None = None  # None | "unknown_tool" | "bad_arguments" | "timeout" | "exception" | ...

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class TurnRecord:
    """One model action and the env's answer to it.

    ``model_span`` and ``env_span`` are ``(start, end)`` offsets into ``response_ids``.
    """

    model_span: tuple[int, int]
    env_span: tuple[int, int]
    parsed: ParsedTurn
    tools: list[ToolRecord] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_span": list(self.model_span),
            "env_span": list(self.env_span),
            "parsed": self.parsed.to_dict(),
            "tools": [t.to_dict() for t in self.tools],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TurnRecord:
        return cls(
            model_span=tuple(data["model_span"]),
            env_span=tuple(data["env_span"]),
            parsed=ParsedTurn.from_dict(data["parsed"]),
            tools=[ToolRecord(**t) for t in data["tools"]],
        )


@dataclass
class Trajectory:
    """A whole episode, token-exact. Serialises losslessly to one JSON line."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)
    turns: list[TurnRecord] = field(default_factory=list)
    terminated: bool = False
    truncated: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def final_answer(self) -> str | None:
        """The last final answer the model gave (``parsed.final`` of the latest turn that has one), or None."""
        return next((t.parsed.final for t in reversed(self.turns) if t.parsed.final is not None), None)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the broken invariant."""
        n = len(self.response_ids)
        if len(self.response_mask) != n or len(self.rollout_logprobs) != n:
            raise ValueError(
                f"trajectory lengths disagree: response_ids={n}, response_mask={len(self.response_mask)}, "
                f"rollout_logprobs={len(self.rollout_logprobs)}"
            )
        if any(m not in (0, 1) for m in self.response_mask):
            raise ValueError("response_mask must contain only 0 (env/prompt token) and 1 (model token)")

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_ids": self.prompt_ids,
            "response_ids": self.response_ids,
            "response_mask": self.response_mask,
            "rollout_logprobs": self.rollout_logprobs,
            "reward": self.reward,
            "reward_components": self.reward_components,
            "turns": [t.to_dict() for t in self.turns],
            "terminated": self.terminated,
            "truncated": self.truncated,
            "metadata": self.metadata,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        return cls(
            prompt_ids=list(data["prompt_ids"]),
            response_ids=list(data["response_ids"]),
            response_mask=list(data["response_mask"]),
            rollout_logprobs=[float(x) for x in data["rollout_logprobs"]],
            reward=float(data["reward"]),
            reward_components=dict(data.get("reward_components", {})),
            turns=[TurnRecord.from_dict(t) for t in data.get("turns", [])],
            terminated=bool(data.get("terminated", False)),
            truncated=bool(data.get("truncated", False)),
            metadata=dict(data.get("metadata", {})),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_json(cls, line: str) -> Trajectory:
        return cls.from_dict(json.loads(line))
