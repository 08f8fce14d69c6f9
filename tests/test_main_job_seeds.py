"""``benchmarks/main_job_seeds.py``: where a run's RL gain came from, read from a synthetic run directory (fast)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _seeds(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the script imports its sibling main_job_repro
    spec = importlib.util.spec_from_file_location("main_job_seeds", BENCH / "main_job_seeds.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _episode(task_id: str, op: str | None, reward: float) -> dict:
    task = {"id": task_id, "prompt": "?", "answer": "1"} | ({"op": op} if op else {})
    return {"task": task, "reward": reward}


def _run(tmp_path: Path, op_a: str | None = "add", op_b: str | None = "sub") -> Path:
    run = tmp_path / "run"
    summary = {"complete": True, "wall_s_this_process": 900.0, "peak_rss_gb": 7.0,
               "eval_after_sft": {"step": 0, "mean": 0.5, "sem": 0.1}, "eval_after": {"step": 2, "mean": 0.75, "sem": 0.1}}
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(summary))
    _write(run / "eval/after_sft/trajectories.jsonl",
           [_episode("a1", op_a, 1.0), _episode("a2", op_a, 0.0), _episode("b1", op_b, 1.0), _episode("b2", op_b, 0.0)])
    _write(run / "eval/step_000002/trajectories.jsonl",
           [_episode("a1", op_a, 1.0), _episode("a2", op_a, 1.0), _episode("b1", op_b, 1.0), _episode("b2", op_b, 0.0)])
    # step 1: an add group with a reward spread, a sub group without; step 2: a flat add group
    _write(run / "trajectories/step_000001.jsonl",
           [_episode("t1", op_a, 1.0), _episode("t1", op_a, 0.0), _episode("t2", op_b, 0.0), _episode("t2", op_b, 0.0)])
    _write(run / "trajectories/step_000002.jsonl", [_episode("t3", op_a, 1.0), _episode("t3", op_a, 1.0)])
    return run


def test_the_gain_is_broken_down_by_operation_with_the_flat_training_groups(tmp_path, monkeypatch):
    line = _seeds(monkeypatch).by_operation(_run(tmp_path))
    assert line == "add 0.50->1.00 (n=2, flat groups 1/2), sub 0.50->0.50 (n=2, flat groups 1/1)"


def test_tasks_without_an_operation_give_no_breakdown(tmp_path, monkeypatch):
    assert _seeds(monkeypatch).by_operation(_run(tmp_path, None, None)) == ""


def test_the_report_prints_the_breakdown_under_each_run(tmp_path, monkeypatch, capsys):
    run = _run(tmp_path)
    assert _seeds(monkeypatch).main([str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{run}: gain 0.250 sem 0.100")
    assert out[1] == "  by operation: add 0.50->1.00 (n=2, flat groups 1/2), sub 0.50->0.50 (n=2, flat groups 1/1)"
    assert out[-1].startswith("main_job_seeds: gains=0.250 sems=0.100 mean_gain=0.250")
