"""Reusable verifiers (math, IFEval constraints, exact match, channel and error penalties) and the
:class:`Rubric` that combines them."""

from agentrl.envs.rewards.base import RewardContext, Rubric, Verifier
from agentrl.envs.rewards.common import ChannelToolCallCount, ErrorCount, ExactMatch, normalize_answer
from agentrl.envs.rewards.math import (
    MathAnswer,
    NumericAnswer,
    extract_boxed,
    math_equal,
    numeric_equal,
    with_boxed_bonus,
)

__all__ = [
    "ChannelToolCallCount",
    "ErrorCount",
    "ExactMatch",
    "MathAnswer",
    "NumericAnswer",
    "RewardContext",
    "Rubric",
    "Verifier",
    "extract_boxed",
    "math_equal",
    "normalize_answer",
    "numeric_equal",
    "with_boxed_bonus",
]
