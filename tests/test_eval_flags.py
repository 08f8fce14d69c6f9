"""``eval.before`` / ``eval.after`` are respected, and summary.json records each held-out evaluation once."""

from __future__ import annotations

import json

import pytest
from _tiny_run import TINY

from agentrl.train.reporting import _eval_figures

A, B, C = ({"step": s, "mean": m} for s, m in ((0, 0.1), (0, 0.2), (3, 0.3)))


@pytest.mark.parametrize(("history", "expected"), [
    ({"after_sft": B, "step_3": C}, {"eval_after_sft": B, "eval_after": C}),  # eval.before=false
    ({"after_sft": B}, {"eval_after": B}),  # SFT only, eval.before=false
    ({"before": A, "after_sft": B}, {"eval_before": A, "eval_after": B}),  # SFT only
    ({"before": A, "after_sft": B, "step_3": C}, {"eval_before": A, "eval_after_sft": B, "eval_after": C}),
    ({"before": A}, {"eval_before": A}),  # eval.after=false
    ({"step_3": C}, {"eval_after": C}),
    ({}, {}),
])
def test_each_evaluation_is_recorded_once(history, expected):
    figures = _eval_figures(history)
    assert figures == expected
    assert len({id(v) for v in figures.values()}) == len(figures)


def test_sft_with_eval_after_false_evaluates_before_only(tmp_path):
    pytest.importorskip("torch")
    from agentrl.cli import main

    run = tmp_path / "run"
    assert main(["sft", "env=retool", *TINY, "steps=1", "num_demos=2",
                 "batch_size=2", "eval.num_tasks=2", "eval.after=false", "rollout.max_new_tokens=4", "threads=1",
                 "trainer.tensorboard=false", "trainer.progress=false", "env_kwargs.sandbox_kwargs.workers=1",
                 f"run_dir={run}"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert "eval_before" in summary and "eval_after" not in summary and "eval_after_sft" not in summary
    assert sorted(p.name for p in (run / "eval").iterdir() if p.is_dir()) == ["before"]
