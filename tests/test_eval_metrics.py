"""pass@k, maj@k and the episode report against hand-computed values."""

from __future__ import annotations

import math

import pytest

from agentrl.evaluation.metrics import default_ks, episode_stats, maj_at_k, pass_at_k, summarize
from agentrl.harmony.trajectory import ToolRecord, Trajectory, TurnRecord
from agentrl.harmony.types import ParsedTurn, ParseError, ParseErrorKind


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (10, 3, 1, 0.3),
        (4, 0, 3, 0.0),
        (4, 4, 1, 1.0),
        (5, 4, 2, 1.0),  # n - c < k: every 2-subset holds a correct sample
        (6, 1, 3, 0.5),  # 1 - C(5,3)/C(6,3) = 1 - 10/20
        (200, 1, 100, 0.5),
    ],
)
def test_pass_at_k_hand_cases(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_closed_form_and_is_stable():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(
                    1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12
                )
    # C(1000, 500) overflows a float; the product form does not
    assert pass_at_k(1000, 3, 500) == pytest.approx(1 - (500 * 499 * 498) / (1000 * 999 * 998), rel=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_maj_at_k_hand_cases():
    answers, correct = ["A", "A", "B"], [True, True, False]
    assert maj_at_k(answers, correct, 1) == (pytest.approx(2 / 3), True)
    # pairs: AA -> 1, AB -> tie 0.5, AB -> 0.5
    assert maj_at_k(answers, correct, 2) == (pytest.approx(2 / 3), True)
    assert maj_at_k(answers, correct, 3) == (1.0, True)
    # samples without an answer do not vote; no votes at all scores 0
    assert maj_at_k([None, "B", None], [False, True, False], 3) == (1.0, True)
    assert maj_at_k([None, None], [False, False], 2) == (0.0, True)
    # the majority wrong answer beats a single right one
    assert maj_at_k(["7", "8", "8"], [True, False, False], 3) == (0.0, True)


def test_maj_at_k_sampled_estimate_is_flagged_and_close():
    answers = ["A"] * 12 + ["B"] * 10 + [None] * 8
    correct = [True] * 12 + [False] * 18
    exact, is_exact = maj_at_k(answers, correct, 5, exact_limit=200_000)
    approx, approx_exact = maj_at_k(answers, correct, 5, exact_limit=10, samples=4000)
    assert is_exact and not approx_exact
    assert approx == pytest.approx(exact, abs=0.03)


def test_default_ks():
    assert default_ks(1) == [1]
    assert default_ks(4) == [1, 2, 4]
    assert default_ks(6) == [1, 2, 4, 6]


def _traj(reward, tools=(), parse_errors=0, truncated=False, answer=None, latency=1.0):
    parsed = ParsedTurn(errors=[ParseError(ParseErrorKind.MALFORMED, "bad")] * parse_errors)
    turn = TurnRecord((0, 3), (3, 5), parsed, [ToolRecord("python", {}, "out", 0.1, e) for e in tools])
    return Trajectory(
        [1, 2],
        [3, 4, 5, 6, 7],
        [1, 1, 1, 0, 0],
        [0.0] * 5,
        reward,
        turns=[turn],
        truncated=truncated,
        latency_s=latency,
        metadata={"answer": answer},
    )


def test_summary_report_counts_tools_errors_and_latency():
    t1 = _traj(1.0, tools=[None, "tool_timeout"], answer="4", latency=1.0)
    t2 = _traj(0.0, tools=["unknown_tool"], parse_errors=1, truncated=True, answer="5", latency=3.0)
    assert episode_stats(t2)["errors"] == {"parse_error": 1, "unknown_tool": 1, "truncation": 1}
    m = summarize({"item": [t1, t2]}, [1, 2], answer=lambda t: t.metadata["answer"])
    assert m["pass@1"] == 0.5 and m["pass@2"] == 1.0 and m["mean@2"] == 0.5
    assert m["maj@2"] == 0.5  # a 1-1 tie between "4" (right) and "5" (wrong)
    assert m["tool_calls_per_episode"] == 1.5
    assert m["tool_success_rate"] == pytest.approx(1 / 3)
    assert m["errors"] == {
        "parse_error": 1,
        "unknown_tool": 1,
        "bad_arguments": 0,
        "tool_timeout": 1,
        "tool_exception": 0,
        "tool_infrastructure": 0,
        "truncation": 1,
        "reward_error": 0,
    }
    assert m["latency_s_mean"] == 2.0 and m["latency_s_p50"] == 2.0
    assert m["gen_tokens_per_episode"] == 3 and m["prompt_tokens_per_episode"] == 2


def test_env_error_counts_are_used_once_and_truncation_is_not_a_parse_error():
    t = _traj(0.0, tools=["unknown_tool"])
    t.errors = {"unknown_tool": 1}  # what the env writes at the end of the episode
    assert episode_stats(t)["errors"] == {"unknown_tool": 1}
    cut = Trajectory(
        [1],
        [2],
        [1],
        [0.0],
        0.0,
        turns=[
            TurnRecord(
                (0, 1), (1, 1), ParsedTurn(errors=[ParseError(ParseErrorKind.TRUNCATED, "no stop token")])
            )
        ],
    )
    assert episode_stats(cut)["errors"] == {"truncation": 1}
