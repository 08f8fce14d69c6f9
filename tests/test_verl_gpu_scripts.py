"""The scripts of the verl GPU run (benchmarks/verl_*): the per-step report, the step-1 comparison's
arithmetic, the bundle's agentrl source, and the driver's shell syntax. Fast; nothing here needs verl."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_run(run: Path, records: list[dict], batch: int = 2, n: int = 2, coeff: float = 0.01) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text(f"rollout:\n  batch_size: {batch}\n  n: {n}\nactor:\n  entropy_coeff: {coeff}\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def _verl_step(step: int, step_s: float, gen: float, **extra) -> dict:
    return {"step": step, "timing_s/step": step_s, "timing_s/gen": gen, "timing_s/old_log_prob": 1.0,
            "timing_s/update_actor": 2.0, "timing_s/update_weights": 0.5, "perf/total_num_tokens": 1000,
            "rollout_corr/kl": 1e-4 * step, "rollout_corr/k3_kl": 2e-4, "training/rollout_probs_diff_mean": 1e-8,
            "training/rollout_probs_diff_max": 1e-6, "actor/grad_norm": 0.5, "actor/loss": -0.12,
            "critic/score/mean": 0.25, **extra}


def test_report_rows_summary_and_line(tmp_path, capsys):
    report = _load("verl_run_report")
    # a resumed run logs steps again from its checkpoint on: the last record of a step wins
    run = _write_run(tmp_path / "verl", [_verl_step(1, 50.0, 10.0), _verl_step(2, 8.0, 4.0, **{"actor/grad_norm": 9.0}),
                                         _verl_step(2, 10.0, 4.0), _verl_step(3, 10.0, 6.0)])
    rows = report.step_rows(str(run))
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["grad_norm"] == 0.5 and rows[1]["step_s"] == 10.0  # the resumed record of step 2
    assert rows[1]["train_s"] == pytest.approx(3.5) and rows[1]["other_s"] == pytest.approx(2.5)
    assert rows[1]["tokens_per_s"] == pytest.approx(100.0)
    summary = report.summary(rows)  # steps 2.. only: step 1 carries start-up and compilation
    assert summary["mean_step_s"] == pytest.approx(10.0) and summary["steps_per_s"] == pytest.approx(0.1)
    assert summary["rollout_s_share"] == pytest.approx(0.5) and summary["mean_kl"] == pytest.approx(2.5e-4)

    # the embedded trainer's records: tokens from lengths x episodes, loss from pg_loss and entropy
    emb = _write_run(tmp_path / "emb", [{"step": 0, "eval/accuracy": 0.0}, {
        "step": 1, "timing_s/step": 2.0, "timing_s/rollout": 1.0, "timing_s/old_log_prob": 0.25,
        "timing_s/update_actor": 0.5, "prompt_length/mean": 100.0, "response_length/mean": 40.0,
        "response_length/env_tokens_mean": 10.0, "actor/pg_loss": 0.3, "actor/entropy": 10.0,
        "rollout_corr/logprob_abs_diff_mean": 4e-3}])
    (row,) = report.step_rows(str(emb))  # step 0 (evaluation) is no training step
    assert row["tokens"] == pytest.approx(4 * 150.0) and row["loss"] == pytest.approx(0.3 - 0.01 * 10.0)
    assert math.isnan(row["probs_diff_mean"]) and row["lp_abs_diff_mean"] == pytest.approx(4e-3)

    step1 = tmp_path / "step1.json"
    step1.write_text(json.dumps({"loss": {"verl": -0.12, "embedded": -0.12, "rel_diff": 1.5e-7}}))
    assert report.main(["--verl", str(run), "--embedded", str(emb), "--step1", str(step1), "--gpus", "1",
                        "--resumed", "yes", "--line"]) == 0
    out = capsys.readouterr().out
    assert "## verl:" in out and "## embedded:" in out and "## step 1" in out
    assert out.strip().splitlines()[-1] == (
        "verl_run: gpus=1 steps=3 resumed=yes step1_loss_rel_diff_vs_embedded=1.5e-07")


def test_step1_compare_arithmetic():
    compare = _load("verl_step1_compare")
    assert compare.rel_diff(0.0, 0.0) == 0.0
    assert compare.rel_diff(-1.0, -1.1) == pytest.approx(0.1 / 1.1)
    ours = {"actor/pg_loss": 0.2, "actor/entropy": 10.0, "actor/grad_norm": 2.0, "entropy_coeff": 0.01,
            "episodes": 4, "groups": 2, "model_tokens": 32}
    verl = {"actor/loss": 0.1, "actor/pg_loss": 0.2, "actor/grad_norm": 2.02, "actor/entropy": 10.0}
    out = compare.compare(verl, ours, reference={**ours, "attn_implementation": "eager", "actor/grad_norm": 2.0})
    assert out["loss"]["embedded"] == pytest.approx(0.1) and out["loss"]["rel_diff"] == pytest.approx(0.0, abs=1e-12)
    assert out["grad_norm"]["rel_diff"] == pytest.approx(0.02 / 2.02)
    assert out["embedded_reference"]["grad_norm_rel_diff_vs_embedded"] == 0.0
    with pytest.raises(SystemExit, match="no loss metric"):
        compare.compare({"actor/pg_loss": 0.2, "actor/grad_norm": 2.0}, ours)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_bundle_builds_agentrl_from_tracked_files_only(tmp_path, monkeypatch):
    bundle = _load("verl_gpu_bundle")
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "kept.py").write_text("x = 1\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "add", "pkg/kept.py"], check=True)
    (repo / "pkg" / "kept.py").write_text("x = 2\n")  # an uncommitted edit of a tracked file travels
    (repo / "pkg" / "untracked.py").write_text("")
    (repo / "build" / "lib" / "pkg").mkdir(parents=True)
    (repo / "build" / "lib" / "pkg" / "stale.py").write_text("")  # leftovers of an old build do not
    monkeypatch.setattr(bundle, "REPO", repo)
    out = bundle.tracked_copy(tmp_path / "src")
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == ["pkg/kept.py"]
    assert (out / "pkg" / "kept.py").read_text() == "x = 2\n"


def test_driver_shell_syntax_and_usage(tmp_path):
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("needs bash")
    driver = BENCH / "verl_gpu_run.sh"
    assert subprocess.run([bash, "-n", str(driver)], capture_output=True).returncode == 0
    out = subprocess.run([bash, str(driver)], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode != 0 and "usage: verl_gpu_run.sh OUT_DIR" in out.stderr
