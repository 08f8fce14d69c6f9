"""The GPT-OSS-20B LoRA run's scripts (benchmarks/gptoss20b_*): the report's figures and summary line from the
two phases' outputs, and the driver's shell syntax. Fast; no GPU."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from _fixtures import BENCH, load_benchmark


def _report():
    return load_benchmark("gptoss20b_report")


def _phase(out: Path, name: str, gaps: list[float], gpu_mib: list[int], peak_logged: float | None = None) -> None:
    phase = out / name
    phase.mkdir(parents=True)
    records = [{"step": i + 1, "perf/gen_tokens_per_s": 100.0 * (i + 1), "perf/train_tokens_per_s": 4000.0,
                "timing_s/step": 60.0 - i, "rollout_corr/logprob_abs_diff_mean": gap, "actor/ppo_ratio_max": 1.0,
                "actor/pg_clipfrac": 0.0, **({"perf/gpu_peak_gb": peak_logged} if peak_logged else {})}
               for i, gap in enumerate(gaps)]
    (phase / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (phase / "gpu_mem.csv").write_text("".join(f"2026/12/01 10:00:0{i}.000, {m}\n" for i, m in enumerate(gpu_mib)))
    (phase / "config.yaml").write_text("actor:\n  lora:\n    rank: 16\n")
    (phase / "contexts.json").write_text(json.dumps({"step_000001.jsonl": 7900, "step_000002.jsonl": 8050}))


def test_lora_20b_report_summary_line(tmp_path, capsys):
    _phase(tmp_path, "replay", gaps=[0.5, 0.01, 0.03], gpu_mib=[60_000, 71_680, 50_000])
    _phase(tmp_path, "noreplay", gaps=[0.9, 0.08], gpu_mib=[70_000])
    _report().main(tmp_path)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    fields = dict(item.split("=") for item in line.removeprefix("gptoss20b: ").split())
    assert fields["params_b"] == "20.91" and fields["lora_rank"] == "16" and fields["steps"] == "3"
    assert float(fields["peak_gpu_gb"]) == pytest.approx(70.0)  # nvidia-smi's largest reading, MiB -> GiB
    assert float(fields["rollout_tok_s"]) == pytest.approx(250)  # steps after the first (compilation)
    assert float(fields["gap_mean_replay"]) == pytest.approx(0.02) and float(fields["gap_mean"]) == pytest.approx(0.08)
    assert float(fields["gap_ratio"]) == pytest.approx(4.0) and float(fields["peak_vs_goal"]) == pytest.approx(70 / 120, abs=0.01)
    assert fields["context_max"] == "8050"


def test_lora_20b_report_prefers_the_trainers_peak_and_takes_one_phase(tmp_path, capsys):
    _phase(tmp_path, "replay", gaps=[0.02, 0.02], gpu_mib=[100_000], peak_logged=55.5)
    _report().main(tmp_path)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "peak_gpu_gb=55.5" in line and "gap_mean=nan" in line and "gap_ratio=nan" in line


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_lora_20b_driver_parses_and_refuses_an_unknown_phase(tmp_path):
    script = BENCH / "gptoss20b_lora.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    bad = subprocess.run(["bash", str(script), str(tmp_path)], env={"PHASE": "both", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "PHASE must be replay or noreplay" in bad.stderr


def _driver_train_args(**shell: str) -> list[str]:
    """The ``agentrl train`` arguments of ``gptoss20b_lora.sh`` as bash expands them with the script's default
    knobs (``shell`` overrides some)."""
    text = (BENCH / "gptoss20b_lora.sh").read_text()
    head = "python3 -m agentrl.cli train"
    start = text.index(head) + len(head)
    words = text[start:text.index('"$@"', start)].replace("\\\n", " ")
    knobs = {"RANK": "16", "REPLAY": "true", "STEPS": "5", "MICRO": "2", "ROWS": "800", "TASKS": "2", "GROUP": "4",
             "TURNS": "2", "NEW_TOKENS": "256", "SANDBOX": "local", "RUN": "/tmp/gptoss20b_replay", **shell}
    script = "".join(f"{k}={v}\n" for k, v in knobs.items()) + "printf '%s\\n' " + words
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_lora_20b_driver_command_line_is_a_valid_config():
    from agentrl.train.config import build_config

    cfg = build_config(_driver_train_args())  # every key exists and every value is valid
    assert (cfg.model, cfg.device, cfg.dtype, cfg.attn_implementation) == ("gpt-oss-20b-random", "cuda", "bfloat16",
                                                                          "agentrl_sink")
    assert (cfg.actor.lora.rank, cfg.actor.lora.alpha, cfg.actor.lr) == (16, 32.0, 1e-5)
    assert cfg.actor.routing_replay and cfg.actor.gradient_checkpointing and cfg.trainer.total_steps == 5
    assert dict(cfg.env_kwargs) == {"tier": "table", "table_rows": 800, "closeness": 1.0, "sandbox": "local"}
    assert not build_config(_driver_train_args(REPLAY="false", STEPS="2")).actor.routing_replay


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_lora_20b_driver_command_runs_one_step_on_a_tiny_gpt_oss_on_the_cpu(tmp_path):
    """The driver's exact keys, with the model, device and sizes made tiny (the extra keys it passes on): one
    LoRA GRPO step with routing replay, chunked log-probs and gradient checkpointing, on-policy ratio 1."""
    from _cli_process import run_here

    args = _driver_train_args(RUN=str(tmp_path / "run"), ROWS="20", NEW_TOKENS="8", TASKS="1", GROUP="2", STEPS="1")
    run_here("train", [*args, "model=tiny-gpt-oss", "model_kwargs.num_layers=1", "device=cpu", "dtype=float32",
                       "attn_implementation=null", "threads=1"])  # sink attention's kernels need a GPU
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 1 and record["actor/on_policy"] == 1.0 and record["actor/ppo_ratio_max"] == 1.0
    assert record["actor/grad_norm"] > 0 and record["reward/closeness/mean"] > 0
