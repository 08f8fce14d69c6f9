"""Math answer verification with math-verify (LaTeX/sympy equivalence) and a fast numeric path.

``math_equal(prediction, gold)`` is True when the prediction's answer (the last ``\\boxed{}`` if any, else
the text) is mathematically equal to the gold answer. math-verify's timeouts use ``signal.alarm``, which only
works in the main thread; elsewhere it runs without a timeout on input cut to ``MAX_CHARS``.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable
from fractions import Fraction
from typing import Any

MAX_CHARS = 4000
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced; None if absent."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def final_answer_text(text: str) -> str:
    """The answer part of a final message: the last ``\\boxed{}`` content if present, else the whole text."""
    boxed = extract_boxed(text)
    return boxed if boxed is not None else text


def to_number(text: str) -> Fraction | None:
    """The text as an exact number if it is one (``"1,234"``, ``"-3.5"``, ``"7/2"``, ``"$18"``, ``"18."``)."""
    t = text.strip().strip("$").replace(",", "").replace("\\$", "").rstrip(".").strip()
    t = re.sub(r"^\\text\{(.*)\}$", r"\1", t)
    try:
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None


def last_number(text: str) -> Fraction | None:
    """The last number written in ``text`` (GSM8K-style answer extraction)."""
    found = _NUMBER.findall(text)
    return to_number(found[-1]) if found else None


def answer_closeness(text: str | None, gold: str, decades: float = 10.0) -> float:
    """How close the last number of ``text``'s answer (its last ``\\boxed{}`` if any, else the whole text) is to
    the number ``gold``, in orders of magnitude: ``1 - |log10(1 + |p|) - log10(1 + |g|)| / decades``, clipped to
    [0, 1]. 1.0 for the same magnitude, 0.0 without a number, with the other sign, or ``decades`` or more
    orders away (or when ``gold`` is not a number)."""
    g = to_number(gold)
    p = last_number(final_answer_text(text)) if text else None
    if g is None or p is None or (p < 0) != (g < 0):
        return 0.0
    gap = abs(math.log10(1 + abs(float(p))) - math.log10(1 + abs(float(g))))
    return max(0.0, 1.0 - gap / decades)


def numeric_equal(prediction: str, gold: str) -> bool:
    """True if the last number of the prediction's answer equals the gold number exactly."""
    g = to_number(gold)
    if g is None:
        return False
    answer = final_answer_text(prediction)
    p = to_number(answer)
    if p is None:
        p = last_number(answer)
    return p is not None and p == g


def math_equal(prediction: str | None, gold: str) -> bool:
    """True if ``prediction`` states an answer equal to ``gold`` (numbers, fractions, LaTeX expressions)."""
    if not prediction:
        return False
    if numeric_equal(prediction, gold):
        return True
    from math_verify import parse, verify

    main = threading.current_thread() is threading.main_thread()
    timeouts: dict[str, Any] = {} if main else {"parsing_timeout": None}
    text = prediction[-MAX_CHARS:]
    boxed = extract_boxed(text)
    try:
        g = parse(f"${gold}$", **timeouts)
        p = parse(f"\\boxed{{{boxed}}}" if boxed is not None else text, **timeouts)
        if not g or not p:
            return False
        return bool(verify(g, p, **({} if main else {"timeout_seconds": None})))
    except Exception:  # noqa: BLE001 - unverifiable output scores 0, never crashes the env
        return False


class MathAnswer:
    """Verifier: 1.0 if the episode's final answer equals ``task[key]`` (math-verify), else 0.0."""

    name = "correct"

    def __init__(self, key: str = "answer") -> None:
        self.key = key

    def __call__(self, ctx: Any) -> float:
        return float(math_equal(ctx.final, str(ctx.task[self.key])))


class NumericAnswer:
    """Verifier: 1.0 if the last number of the final answer equals ``task[key]`` exactly (GSM8K)."""

    name = "correct"

    def __init__(self, key: str = "answer") -> None:
        self.key = key

    def __call__(self, ctx: Any) -> float:
        return float(bool(ctx.final) and numeric_equal(ctx.final, str(ctx.task[self.key])))


def with_boxed_bonus(rubric: Callable[[Any], tuple[float, dict[str, float]]] | None, weight: float) -> Callable:
    """Wrap an env rubric: adds component ``boxed`` (1.0 if the final answer contains a ``\\boxed{...}``)
    with ``weight`` to the total (``data.format_reward`` of ``agentrl train``). ``rubric`` returns
    ``(total, components)``; None counts as 0."""

    def reward(ctx: Any) -> tuple[float, dict[str, float]]:
        total, components = rubric(ctx) if rubric is not None else (0.0, {})
        boxed = float(bool(ctx.final) and extract_boxed(ctx.final) is not None)
        return total + weight * boxed, {**components, "boxed": boxed}

    return reward
