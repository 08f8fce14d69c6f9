"""Rewards: verifiers score one finished episode; a :class:`Rubric` combines them with weights.

A verifier is any callable ``(ctx: RewardContext) -> float``, with a ``name`` attribute (or a name given
in the rubric). The rubric returns ``(total, components)``: ``components`` maps each verifier's name to its
raw score, and ``total`` is the weighted sum. Envs store both in the trajectory
(``reward`` and ``reward_components``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from agentrl.harmony.trajectory import ToolRecord, Trajectory
from agentrl.harmony.types import Message, ToolCall


@dataclass
class RewardContext:
    """Everything a verifier may look at once an episode has ended.

    - ``task``: the task dict (``prompt``, ``answer``, env-specific fields).
    - ``final``: the final answer text (Harmony ``final`` channel, or a chat model's last plain reply), or
      ``None`` if the episode ended without one.
    - ``messages``: every assistant message of the episode, in order, with channel and recipient.
    - ``trajectory``: the token-exact trajectory (turn records with parse results and tool records).
    - ``truncated``: the episode hit a limit.
    """

    task: dict[str, Any]
    final: str | None
    messages: list[Message]
    trajectory: Trajectory
    truncated: bool = False

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [c for t in self.trajectory.turns for c in t.parsed.tool_calls]

    @property
    def tool_records(self) -> list[ToolRecord]:
        return [r for t in self.trajectory.turns for r in t.tools]


class Verifier(Protocol):
    name: str

    def __call__(self, ctx: RewardContext) -> float: ...


class Rubric:
    """A weighted sum of verifiers.

    Args:
        items: verifiers, or ``(verifier, weight)`` pairs, or ``(name, verifier, weight)`` triples.
    """

    def __init__(self, items: Iterable[Any]) -> None:
        self.items: list[tuple[str, Callable[[RewardContext], float], float]] = []
        for it in items:
            if isinstance(it, tuple) and len(it) == 3:
                name, fn, w = it
            elif isinstance(it, tuple) and len(it) == 2:
                fn, w = it
                name = _name_of(fn)
            else:
                fn, w, name = it, 1.0, _name_of(it)
            if any(n == name for n, _, _ in self.items):
                raise ValueError(f"two rubric components are named {name!r}; give one an explicit name")
            self.items.append((name, fn, float(w)))

    def __call__(self, ctx: RewardContext) -> tuple[float, dict[str, float]]:
        components = {name: float(fn(ctx)) for name, fn, _ in self.items}
        total = sum(w * components[name] for name, _, w in self.items)
        return total, components


def _name_of(fn: Any) -> str:
    return getattr(fn, "name", None) or getattr(fn, "__name__", None) or type(fn).__name__
