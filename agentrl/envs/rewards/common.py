"""General verifiers: exact match, per-channel penalties, error and format penalties."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from agentrl.envs.rewards.math import final_answer_text


def normalize_answer(text: str) -> str:
    """Lower-case, strip surrounding punctuation/quotes/markdown and collapse whitespace."""
    t = final_answer_text(text).strip().lower()
    t = re.sub(r"\s+", " ", t)
    return t.strip(" \t\n.'\"`*")


class ExactMatch:
    """Verifier: 1.0 if the normalised final answer equals the normalised ``task[key]``.

    ``normalize`` defaults to :func:`normalize_answer` (the last ``\\boxed{}`` counts when present).
    """

    name = "exact_match"

    def __init__(self, key: str = "answer", normalize: Callable[[str], str] = normalize_answer) -> None:
        self.key, self.normalize = key, normalize

    def __call__(self, ctx: Any) -> float:
        if ctx.final is None:
            return 0.0
        return float(self.normalize(ctx.final) == self.normalize(str(ctx.task[self.key])))


class ChannelToolCallCount:
    """Verifier: the number of tool calls the model addressed from ``channel`` (e.g. function calls written in
    Harmony's ``analysis`` channel, which the format forbids; the parser rejects them, so they are counted from
    the messages, dispatched or not). ``functions_only`` ignores built-in tools (``python``, ``browser``),
    which do belong in analysis. Give it a negative weight in a rubric to penalise such calls."""

    def __init__(self, channel: str = "analysis", *, functions_only: bool = True) -> None:
        self.channel, self.functions_only = channel, functions_only
        self.name = f"tool_calls_in_{channel}"

    def __call__(self, ctx: Any) -> float:
        return float(
            sum(
                1
                for m in ctx.messages
                if m.recipient
                and m.channel == self.channel
                and (not self.functions_only or m.recipient.startswith("functions."))
            )
        )


class ErrorCount:
    """Verifier: how many errors of the given kinds (default: all) the episode recorded (parse errors,
    unknown tools, bad arguments, timeouts, exceptions, truncated actions). Use with a negative weight."""

    def __init__(self, kinds: tuple[str, ...] | None = None, name: str = "errors") -> None:
        self.kinds, self.name = kinds, name

    def __call__(self, ctx: Any) -> float:
        errors = ctx.trajectory.errors
        return float(sum(n for k, n in errors.items() if self.kinds is None or k in self.kinds))
