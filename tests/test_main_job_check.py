"""``benchmarks/main_job_check.py``: the guard of the headline, on synthetic run directories (fast)."""

from __future__ import annotations

import json

import pytest
from _fixtures import BENCH, load_benchmark


def _check():
    return load_benchmark("main_job_check")


def _summary(**overrides):
    summary = {
        "complete": True, "stopped_by": None, "steps": 10, "total_steps": 10, "infra_errors": 0, "infra_retries": 3,
        "incomplete_evaluations": 0, "commit": "abc123",
        "eval_before": {"mean": 0.0, "sem": 0.0, "tool_success_rate": None},
        "eval_after_sft": {"mean": 0.66, "sem": 0.04, "tool_success_rate": 1.0},
        "eval_after": {"mean": 0.78, "sem": 0.037, "tool_success_rate": 0.99},
        "wall_s_this_process": 1001.4, "peak_rss_gb": 7.5, "peak_rss_children_gb": 0.3,
    }
    summary.update(overrides)
    return summary


def _run(tmp_path, capsys, summary, *args):
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "summary.json").write_text(json.dumps(summary))
    code = _check().main([str(run), *args])
    return code, capsys.readouterr().out.strip().splitlines()


def test_a_run_that_holds_up_passes_and_prints_the_line(tmp_path, capsys):
    code, out = _run(tmp_path, capsys, _summary())
    assert code == 0 and len(out) == 1
    assert out[-1] == ("main_job: before=0.000 after_sft=0.660 after_rl=0.780 tool_success_after=0.990 "
                       "infra_errors=0 wall_s=1001 peak_rss_gb=7.50 commit=abc123")


def test_the_readme_figures_are_read_from_the_readme():
    figures = _check().readme_figures(BENCH.parent / "README.md")
    assert set(figures) == {"before", "after_sft", "after_rl"}
    assert all(0.0 <= v <= 1.0 for v in figures.values())


@pytest.mark.parametrize(("overrides", "problem"), [
    ({"infra_errors": 43, "complete": False}, "43 infrastructure errors remain"),
    ({"incomplete_evaluations": 1, "complete": False}, "1 held-out evaluations are incomplete"),
    ({"complete": False, "stopped_by": "max_wall_s"}, "the run is not complete (stopped_by=max_wall_s"),
    ({"eval_after_sft": {"mean": 0.461, "sem": 0.044, "tool_success_rate": 0.66}},
     "after_sft: held-out reward 0.461 ± 0.044 is below the README's 0.672 by more than 2 sem"),
])
def test_each_failure_exits_non_zero(tmp_path, capsys, overrides, problem):
    code, out = _run(tmp_path, capsys, _summary(**overrides), "--before", "0", "--after-sft", "0.672",
                     "--after-rl", "0.773")
    assert code == 1 and any(problem in line for line in out[:-1]), out
    assert out[-1].startswith("main_job: ")


def test_a_score_within_two_sem_of_the_readme_passes(tmp_path, capsys):
    # 0.60 + 2 * 0.04 = 0.68 >= 0.672: within the noise
    after_sft = {"mean": 0.60, "sem": 0.04, "tool_success_rate": 1.0}
    code, _ = _run(tmp_path, capsys, _summary(eval_after_sft=after_sft), "--after-sft", "0.672", "--before", "0",
                   "--after-rl", "0.773")
    assert code == 0


def test_a_run_that_predates_the_count_fails_and_says_why(tmp_path, capsys):
    summary = _summary()
    del summary["infra_errors"], summary["commit"]
    code, out = _run(tmp_path, capsys, summary)
    assert code == 1 and "predates the count" in out[0]
    assert "infra_errors=unknown" in out[-1] and out[-1].endswith("commit=unknown")


def test_an_unreadable_run_is_exit_2(tmp_path, capsys):
    assert _check().main([str(tmp_path / "missing")]) == 2
