"""Final answers of eval episodes, normalised for majority voting (maj@k).

``env`` below is an env or an env class: only its ``rubric`` is read.
"""

from __future__ import annotations

from typing import Any


def answers_comparable(env: Any) -> bool:
    """Whether ``env``'s answers can be compared for a majority vote: it is graded on an answer (a rubric
    verifier of type NumericAnswer, MathAnswer or ExactMatch), not on free text."""
    from agentrl.envs.rewards.common import ExactMatch
    from agentrl.envs.rewards.math import MathAnswer, NumericAnswer

    verifiers = [fn for _, fn, _ in getattr(getattr(env, "rubric", None), "items", [])]
    return any(isinstance(v, (MathAnswer, NumericAnswer, ExactMatch)) for v in verifiers)


def comparable_answer(env: Any, final: str | None) -> str | None:
    """A normalised answer for majority voting (see :func:`answers_comparable`); ``None`` without a final
    answer or when answers are not comparable. Math/number answers are normalised exactly (``"1,000"``,
    ``"1000.0"`` -> ``"1000"``); ExactMatch answers by the verifier's own normalisation; others by whitespace."""
    from agentrl.envs.rewards.common import ExactMatch
    from agentrl.envs.rewards.math import MathAnswer, NumericAnswer, final_answer_text, last_number, to_number

    verifiers = [fn for _, fn, _ in getattr(getattr(env, "rubric", None), "items", [])]
    if final is None or not answers_comparable(env):
        return None
    if not any(isinstance(v, (MathAnswer, NumericAnswer)) for v in verifiers):
        exact = next(v for v in verifiers if isinstance(v, ExactMatch))
        return exact.normalize(final)
    text = final_answer_text(final).strip()
    number = to_number(text)
    if number is None and any(isinstance(v, NumericAnswer) for v in verifiers):
        number = last_number(text)
    return str(number) if number is not None else " ".join(text.split())

