"""Evaluation metrics over sampled episodes: pass@k, mean@k, maj@k and the tool-use report.

Everything here is a pure function of plain data so it can be checked against hand-computed cases.

- :func:`pass_at_k`: the unbiased estimator of Chen et al. (2021),
  ``1 - C(n - c, k) / C(n, k)``, computed in the numerically stable product form
  ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)``.
- :func:`maj_at_k`: the exact expected correctness of a majority vote over a uniformly random
  size-``k`` subset of the ``n`` samples (ties broken uniformly at random), so it is as unbiased as
  pass@k. It enumerates subsets when there are at most ``exact_limit`` of them and otherwise averages
  a fixed-seed sample of subsets (documented in the result as an estimate).
- :func:`episode_stats` / :func:`summarize`: tool calls per episode, tool success rate, the error
  taxonomy, latency and token counts from :class:`~agentrl.harmony.trajectory.Trajectory` records.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

#: Error taxonomy reported by ``agentrl eval``; every episode error maps onto exactly one of these.
ERROR_KINDS = ("parse_error", "unknown_tool", "bad_arguments", "tool_timeout", "tool_exception", "truncation", "reward_error")

_TOOL_ERROR_ALIASES = {
    "unknown_tool": "unknown_tool",
    "unknown_recipient": "unknown_tool",
    "bad_arguments": "bad_arguments",
    "bad_json": "bad_arguments",
    "tool_timeout": "tool_timeout",
    "timeout": "tool_timeout",
    "tool_exception": "tool_exception",
    "exception": "tool_exception",
    "truncation": "truncation",
    "parse_error": "parse_error",
}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of ``k`` samples drawn without replacement from ``n`` samples,
    ``c`` of them correct, is correct. Raises ``ValueError`` unless ``0 <= c <= n`` and ``1 <= k <= n``."""
    if not (0 <= c <= n) or not (1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def _vote(answers: Sequence[Hashable | None], correct: Sequence[bool]) -> float:
    """Expected correctness of a majority vote (uniform tie-break); ``None`` answers do not vote."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    winners = [a for a, v in votes.items() if v == top]
    right = {a for a, ok in zip(answers, correct, strict=True) if ok and a is not None}
    return sum(1 for a in winners if a in right) / len(winners)


def maj_at_k(
    answers: Sequence[Hashable | None],
    correct: Sequence[bool],
    k: int,
    *,
    exact_limit: int = 20_000,
    samples: int = 2_000,
    seed: int = 0,
) -> tuple[float, bool]:
    """Expected majority-vote correctness over size-``k`` subsets of one item's ``n`` samples.

    ``answers[i]`` is the comparable (normalised) answer of sample ``i`` or ``None`` if it gave none;
    ``correct[i]`` whether it was right. Returns ``(value, exact)``: ``exact`` is False when the
    number of subsets exceeded ``exact_limit`` and ``samples`` fixed-seed random subsets were averaged.
    """
    n = len(answers)
    if len(correct) != n:
        raise ValueError(f"maj@k: {n} answers but {len(correct)} correctness flags")
    if not 1 <= k <= n:
        raise ValueError(f"maj@k needs 1 <= k <= n, got n={n}, k={k}")
    if math.comb(n, k) <= exact_limit:
        subsets: Iterable[Sequence[int]] = itertools.combinations(range(n), k)
        count, exact = math.comb(n, k), True
    else:
        rng = random.Random(seed)
        subsets = (rng.sample(range(n), k) for _ in range(samples))
        count, exact = samples, False
    total = sum(_vote([answers[i] for i in s], [correct[i] for i in s]) for s in subsets)
    return total / count, exact


def default_ks(n: int) -> list[int]:
    """Powers of two up to ``n``, plus ``n`` itself: ``n=6 -> [1, 2, 4, 6]``."""
    ks = [1 << i for i in range(n.bit_length()) if (1 << i) <= n]
    return ks if ks[-1] == n else ks + [n]


def normalize_error(kind: str | None) -> str | None:
    """Map an env/tool error string onto :data:`ERROR_KINDS` (unknown kinds keep their own name)."""
    if kind is None:
        return None
    return _TOOL_ERROR_ALIASES.get(kind, kind)


def turn_errors(traj: Any) -> Counter[str]:
    """The error taxonomy recomputed from the turn records: one ``truncation`` per completion cut off
    (parse error kind ``truncated``), one ``parse_error`` per other parse error, one per failed tool call."""
    errors: Counter[str] = Counter()
    for turn in traj.turns:
        for err in turn.parsed.errors:
            kind = err.kind.value if hasattr(err.kind, "value") else str(err.kind)
            errors["truncation" if kind == "truncated" else "parse_error"] += 1
        errors.update(normalize_error(rec.error) for rec in turn.tools if rec.error)
    return errors


def episode_stats(traj: Any) -> dict[str, Any]:
    """Per-episode numbers from a :class:`Trajectory`: tool calls, tool errors, error taxonomy counts,
    generated/prompt tokens, latency (``metadata["latency_s"]``) and model requests.

    Errors are the env's own counts (``metadata["errors"]``, kind -> count, written when the episode
    ends) or, for trajectories without them, :func:`turn_errors`. An episode cut by a limit
    (``truncated``) counts as one ``truncation`` unless a truncation was already counted.
    """
    tool_calls = sum(len(turn.tools) for turn in traj.turns)
    tool_ok = sum(1 for turn in traj.turns for rec in turn.tools if rec.error is None)
    env_errors = traj.metadata.get("errors")
    if isinstance(env_errors, dict):
        errors: Counter[str] = Counter()
        for kind, count in env_errors.items():
            errors[normalize_error(kind)] += int(count)
    else:
        errors = turn_errors(traj)
    if traj.truncated and not errors["truncation"]:
        errors["truncation"] += 1
    meta = traj.metadata
    return {
        "tool_calls": tool_calls,
        "tool_ok": tool_ok,
        "errors": dict(errors),
        "gen_tokens": int(meta.get("gen_tokens", sum(traj.response_mask))),
        "prompt_tokens": int(meta.get("prompt_tokens", len(traj.prompt_ids))),
        "latency_s": float(meta.get("latency_s", 0.0)),
        "requests": int(meta.get("requests", traj.num_turns)),
    }


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _percentile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(
    items: dict[Hashable, list[Any]],
    ks: Sequence[int] | None = None,
    *,
    success_threshold: float = 1.0,
) -> dict[str, Any]:
    """Aggregate metrics over items, each with its list of sampled :class:`Trajectory` records.

    A sample is correct if ``metadata["correct"]`` is true, or, when absent, if its reward is at least
    ``success_threshold``. A ``metadata["answer"]`` key (the comparable answer, ``None`` when the sample
    gave none) enables maj@k: it is reported whenever answers can be compared, even if none was given. pass@k and
    maj@k are reported for each ``k`` in ``ks`` not above the smallest per-item sample count.
    """
    if not items:
        return {"items": 0, "episodes": 0}
    n_min = min(len(v) for v in items.values())
    ks = [k for k in (ks or default_ks(n_min)) if 1 <= k <= n_min]
    pass_k = {k: [] for k in ks}
    maj_k: dict[int, list[float]] = {k: [] for k in ks}
    maj_exact = True
    has_answers = False
    mean_reward, mean_correct = [], []
    stats = []
    for trajs in items.values():
        correct = [
            bool(t.metadata["correct"]) if "correct" in t.metadata else t.reward >= success_threshold
            for t in trajs
        ]
        for k in ks:
            pass_k[k].append(pass_at_k(len(trajs), sum(correct), k))
        answers = [t.metadata.get("answer") for t in trajs]
        if any("answer" in t.metadata for t in trajs):
            has_answers = True
        for k in ks:
            value, exact = maj_at_k([None if a is None else str(a) for a in answers], correct, k)
            maj_k[k].append(value)
            maj_exact &= exact
        mean_reward.append(_mean([t.reward for t in trajs]))
        mean_correct.append(_mean([float(c) for c in correct]))
        stats += [episode_stats(t) for t in trajs]
    tool_calls = sum(s["tool_calls"] for s in stats)
    errors: Counter[str] = Counter({k: 0 for k in ERROR_KINDS})
    for s in stats:
        errors.update(s["errors"])
    latencies = [s["latency_s"] for s in stats]
    out: dict[str, Any] = {
        "items": len(items),
        "episodes": len(stats),
        "samples_per_item": n_min,
        **{f"pass@{k}": _mean(v) for k, v in pass_k.items()},
        f"mean@{n_min}": _mean(mean_correct),
        "mean_reward": _mean(mean_reward),
        "tool_calls_per_episode": tool_calls / len(stats),
        "tool_success_rate": (sum(s["tool_ok"] for s in stats) / tool_calls) if tool_calls else None,
        "errors": dict(errors),
        "errors_per_episode": {k: v / len(stats) for k, v in errors.items()},
        "latency_s_mean": _mean(latencies),
        "latency_s_p50": _percentile(latencies, 0.5),
        "latency_s_p95": _percentile(latencies, 0.95),
        "gen_tokens_per_episode": _mean([s["gen_tokens"] for s in stats]),
        "prompt_tokens_per_episode": _mean([s["prompt_tokens"] for s in stats]),
        "requests_per_episode": _mean([s["requests"] for s in stats]),
    }
    if has_answers:
        out.update({f"maj@{k}": _mean(v) for k, v in maj_k.items()})
        out["maj_exact"] = maj_exact
    return out
