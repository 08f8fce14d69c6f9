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
  taxonomy, latency and token counts from :class:`~agentrl.harmony.trajectory.Trajectory` records, whose
  correctness (:attr:`~agentrl.harmony.trajectory.Trajectory.correct`), error taxonomy and tool statistics
  are defined once, on the record.
- :func:`headline`: the figures a training run reports for each held-out evaluation (``summary.json``).
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

from agentrl.harmony.trajectory import ERROR_KINDS, Trajectory

__all__ = [
    "ERROR_KINDS", "default_ks", "episode_stats", "headline", "maj_at_k", "mean_and_sem", "pass_at_k", "summarize",
]


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


def episode_stats(traj: Trajectory) -> dict[str, Any]:
    """Per-episode numbers from a :class:`Trajectory`: tool calls and failed ones (:attr:`Trajectory.tool_calls`,
    :attr:`Trajectory.tool_errors`), the error taxonomy counts (:meth:`Trajectory.error_counts`), turns,
    generated/prompt tokens (an API's reported ``usage`` when it has one, else the trajectory's own), latency
    and model requests."""
    usage = traj.usage
    return {
        "tool_calls": traj.tool_calls,
        "tool_ok": traj.tool_calls - traj.tool_errors,
        "errors": dict(traj.error_counts()),
        "turns": traj.num_turns,
        "gen_tokens": int(usage.get("completion_tokens", sum(traj.response_mask))),
        "prompt_tokens": int(usage.get("prompt_tokens", len(traj.prompt_ids))),
        "latency_s": float(traj.latency_s or 0.0),
        "requests": int(traj.requests if traj.requests is not None else traj.num_turns),
    }


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def mean_and_sem(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (sample std / sqrt(n); 0 for n < 2; NaN for no values)."""
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def _percentile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(
    items: dict[Hashable, list[Trajectory]],
    ks: Sequence[int] | None = None,
    *,
    answer: Callable[[Trajectory], Hashable | None] | None = None,
) -> dict[str, Any]:
    """Aggregate metrics over items (in the dict's order), each with its list of sampled trajectories.

    A sample is correct per :attr:`Trajectory.correct`. ``answer`` (a sample's comparable answer, ``None`` when
    it gave none) enables maj@k: pass it whenever answers can be compared, even if none was given. pass@k and
    maj@k are reported for each ``k`` in ``ks`` not above the smallest per-item sample count. ``mean_reward``
    averages the per-item means, ``reward_sem`` is the standard error over episodes, ``tool_call_rate`` the
    share of episodes with at least one tool call.
    """
    if not items:
        return {"items": 0, "episodes": 0}
    n_min = min(len(v) for v in items.values())
    ks = [k for k in (ks or default_ks(n_min)) if 1 <= k <= n_min]
    pass_k: dict[int, list[float]] = {k: [] for k in ks}
    maj_k: dict[int, list[float]] = {k: [] for k in ks}
    maj_exact = True
    mean_reward, mean_correct, rewards, stats = [], [], [], []
    for trajs in items.values():
        correct = [t.correct for t in trajs]
        for k in ks:
            pass_k[k].append(pass_at_k(len(trajs), sum(correct), k))
        if answer is not None:
            answers = [answer(t) for t in trajs]
            for k in ks:
                value, exact = maj_at_k([None if a is None else str(a) for a in answers], correct, k)
                maj_k[k].append(value)
                maj_exact &= exact
        rewards += [t.reward for t in trajs]
        mean_reward.append(_mean([t.reward for t in trajs]))
        mean_correct.append(_mean([float(c) for c in correct]))
        stats += [episode_stats(t) for t in trajs]
    out = {
        "items": len(items),
        "episodes": len(stats),
        "samples_per_item": n_min,
        **{f"pass@{k}": _mean(v) for k, v in pass_k.items()},
        f"mean@{n_min}": _mean(mean_correct),
        "mean_reward": _mean(mean_reward),
        "reward_sem": mean_and_sem(rewards)[1],
        **_episode_summary(stats),
    }
    if answer is not None:
        out.update({f"maj@{k}": _mean(v) for k, v in maj_k.items()})
        out["maj_exact"] = maj_exact
    return out


def _episode_summary(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """Tool use, error taxonomy, turns, latency and tokens over :func:`episode_stats` records."""
    tool_calls = sum(s["tool_calls"] for s in stats)
    errors: Counter[str] = Counter({k: 0 for k in ERROR_KINDS})
    for s in stats:
        errors.update(s["errors"])
    latencies = [s["latency_s"] for s in stats]
    return {
        "tool_calls_per_episode": tool_calls / len(stats),
        "tool_call_rate": sum(1 for s in stats if s["tool_calls"]) / len(stats),
        "tool_success_rate": (sum(s["tool_ok"] for s in stats) / tool_calls) if tool_calls else None,
        "turns_per_episode": _mean([s["turns"] for s in stats]),
        "errors": dict(errors),
        "errors_per_episode": {k: v / len(stats) for k, v in errors.items()},
        "latency_s_mean": _mean(latencies),
        "latency_s_p50": _percentile(latencies, 0.5),
        "latency_s_p95": _percentile(latencies, 0.95),
        "gen_tokens_per_episode": _mean([s["gen_tokens"] for s in stats]),
        "prompt_tokens_per_episode": _mean([s["prompt_tokens"] for s in stats]),
        "requests_per_episode": _mean([s["requests"] for s in stats]),
    }


#: summary.json / eval_history key -> the :func:`summarize` key it reports
HEADLINE = {
    "mean": "mean_reward",
    "sem": "reward_sem",
    "tool_call_rate": "tool_call_rate",
    "tool_success_rate": "tool_success_rate",
    "tool_calls_mean": "tool_calls_per_episode",
    "turns_mean": "turns_per_episode",
}


def headline(metrics: dict[str, Any]) -> dict[str, Any]:
    """The figures a training run keeps for each held-out evaluation (``summary.json``'s ``eval_before`` /
    ``eval_after_sft`` / ``eval_after``) from :func:`summarize`'s metrics: ``mean`` and ``sem`` of the reward,
    ``tool_call_rate`` (share of episodes with a tool call), ``tool_success_rate`` (share of tool calls without
    an error kind; ``None`` when no tool was called), ``tool_calls_mean``, ``turns_mean``, plus every
    ``pass@k`` / ``maj@k`` / ``mean@n``, the ``episodes`` evaluated and the ``errors`` taxonomy counts, and from
    the run's record (``metrics["run"]``) ``incomplete`` (episodes that failed and are left out of the figures),
    ``infra_errors`` (of them, those a tool's backend ended: not wrong answers) and ``infra_retries``."""
    out = {name: metrics.get(key) for name, key in HEADLINE.items()}
    out.update({k: v for k, v in metrics.items() if k.startswith(("pass@", "maj@", "mean@"))})
    out["episodes"] = metrics.get("episodes", 0)
    out["errors"] = dict(metrics.get("errors", {}))
    run = metrics.get("run") or {}
    out["incomplete"] = int(run.get("episodes_failed", 0))
    out["infra_errors"] = int(run.get("infra_errors", 0))
    out["infra_retries"] = int(run.get("infra_retries", 0))
    return out
