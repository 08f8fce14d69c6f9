"""Eval polish: maj@k wherever answers compare, --compare warnings, and episodes that end without a stop
token reported as truncated and counted once."""

from __future__ import annotations

import json

import agentrl
from agentrl.evaluation.answers import answers_comparable, comparable_answer
from agentrl.evaluation.metrics import episode_stats, summarize
from agentrl.evaluation.report import compare_warnings
from agentrl.evaluation.store import items_digest
from agentrl.harmony import default_format
from agentrl.harmony.trajectory import Trajectory
from agentrl.harmony.types import Message


def _traj(answer=None, correct=False) -> Trajectory:
    t = Trajectory(prompt_ids=[1], response_ids=[2], response_mask=[1], rollout_logprobs=[0.0])
    t.reward = float(correct)
    t.metadata["answer"] = answer  # what a test answer function below reads
    return t


def _answer(t: Trajectory):
    return t.metadata["answer"]


def test_comparable_answers_by_rubric():
    gsm8k, retool, jobs, verifyif = (agentrl.make(n) for n in ("gsm8k", "retool", "jobs", "verifyif"))
    try:
        assert answers_comparable(gsm8k) and answers_comparable(retool) and answers_comparable(jobs)
        assert not answers_comparable(verifyif)  # free text scored by constraints: no vote
        assert comparable_answer(gsm8k, "It is 1,000.0 dollars") == "1000"
        assert comparable_answer(jobs, "  Acme Corp. ") == comparable_answer(jobs, "acme corp")
        assert comparable_answer(verifyif, "anything") is None and comparable_answer(gsm8k, None) is None
    finally:
        for env in (gsm8k, retool, jobs, verifyif):
            env.close()


def test_maj_at_k_is_reported_when_answers_compare_even_if_none_was_given():
    no_answers = {"a": [_traj(), _traj()], "b": [_traj(), _traj()]}
    m = summarize(no_answers, [1, 2], answer=_answer)
    assert m["maj@1"] == 0.0 and m["maj@2"] == 0.0
    free_text = {"a": [_traj(), _traj()]}
    assert "maj@1" not in summarize(free_text, [1, 2])  # no answer function: answers do not compare
    voted = {"a": [_traj("4", True), _traj("4", True), _traj("5")]}
    assert summarize(voted, [3], answer=_answer)["maj@3"] == 1.0


def test_compare_warns_when_runs_differ_in_env_or_items():
    a = {"env": "gsm8k", "items": 10, "items_digest": "x"}
    assert compare_warnings(a, dict(a)) == []
    assert "different envs" in compare_warnings(a, {**a, "env": "retool"})[0]
    assert "numbers of items" in compare_warnings(a, {**a, "items": 12})[0]
    assert "different items" in compare_warnings(a, {**a, "items_digest": "y"})[0]
    same_ids = [("0", {"prompt": "1+1?"})], [("0", {"prompt": "2+2?"})]
    assert items_digest(same_ids[0]) != items_digest(same_ids[1])  # same ids, other tasks


def test_compare_cli_prints_the_warning(tmp_path, capsys):
    from agentrl.evaluation.cli import main

    for name, env in (("a", "gsm8k"), ("b", "retool")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.json").write_text(json.dumps({"env": env, "items": 3, "items_digest": "d"}))
    assert main(["--compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "different envs" in capsys.readouterr().out


def test_an_episode_cut_before_its_stop_token_is_truncated_and_counted_once():
    fmt = default_format()
    env = agentrl.make("gsm8k")
    task = env.tasks(n=1, seed=0)[0]
    env.reset(options={"task": task})
    cut = fmt.render_completion([Message("assistant", "The answer is 4", channel="final")])[:-1]
    _, reward, terminated, truncated, info = env.step(cut)
    traj = info["trajectory"]
    assert (terminated, truncated, traj.truncated, info["stop_reason"]) == (False, True, True, "token_limit")
    assert episode_stats(traj)["errors"] == {"truncation": 1}
    assert summarize({"0": [traj]})["errors"]["truncation"] == 1
    env.close()
