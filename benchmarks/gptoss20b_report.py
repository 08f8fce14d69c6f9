"""The GPT-OSS-20B LoRA run's figures, from the phases of ``benchmarks/gptoss20b_lora.sh`` in OUT_DIR.

usage: python benchmarks/gptoss20b_report.py OUT_DIR

Reads ``OUT_DIR/replay/`` (routing replay on) and ``OUT_DIR/noreplay/`` (off), either may be missing, and prints
a table per phase, then one summary line last, in the issue's RESULTS.md format plus the comparisons:

    gptoss20b: params_b=<> lora_rank=<> steps=<> peak_gpu_gb=<> rollout_tok_s=<> train_tok_s=<> step_s=<>
    gap_mean=<> gap_mean_replay=<> gap_ratio=<without / with replay> peak_vs_goal=<peak / 120 GB>
    context_max=<tokens>

Figures are means over the replay run's steps after the first (the first step compiles kernels), except
``steps`` and the peak. ``peak_gpu_gb``: the trainer's ``perf/gpu_peak_gb`` when it logs one, else the largest
``memory.used`` nvidia-smi saw (that includes the CUDA context and the allocator's cache, so it is an upper
bound). The gap is ``rollout_corr/logprob_abs_diff_mean`` (mean |log p_train - log p_rollout| over model tokens).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

GOAL_GB = 120.0
FIGURES = {
    "rollout_tok_s": "perf/gen_tokens_per_s",
    "train_tok_s": "perf/train_tokens_per_s",
    "step_s": "timing_s/step",
    "rollout_s": "timing_s/rollout",
    "gen_s": "timing_s/gen",
    "update_s": "timing_s/update_actor",
    "gap_mean": "rollout_corr/logprob_abs_diff_mean",
    "ppo_ratio_max": "actor/ppo_ratio_max",
    "ppo_ratio_min": "actor/ppo_ratio_min",
    "pg_clipfrac": "actor/pg_clipfrac",
    "on_policy": "actor/on_policy",
    "grad_norm": "actor/grad_norm",
    "reward": "critic/score/mean",
}


def _records(phase: Path) -> list[dict]:
    path = phase / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _mean(records: list[dict], key: str) -> float:
    values = [r[key] for r in (records[1:] or records) if isinstance(r.get(key), (int, float))]
    return sum(values) / len(values) if values else math.nan


def _peak_gb(phase: Path, records: list[dict]) -> float:
    logged = [r["perf/gpu_peak_gb"] for r in records if "perf/gpu_peak_gb" in r]
    if logged:
        return max(logged)
    csv = phase / "gpu_mem.csv"
    used = [float(line.split(",")[-1]) for line in csv.read_text().splitlines() if line.strip()] if csv.is_file() else []
    return max(used) / 1024 if used else math.nan


def _rank(phase: Path) -> str:
    config = phase / "config.yaml"
    if not config.is_file():
        return "nan"
    from omegaconf import OmegaConf

    lora = OmegaConf.load(config).get("actor", {}).get("lora", {})
    return str(lora.get("rank", "nan"))


def _params_b() -> float:
    from agentrl.models.gpt_oss_20b import count_parameters, gpt_oss_20b_config

    return count_parameters(gpt_oss_20b_config()) / 1e9


def main(out: Path) -> None:
    phases = {name: _records(out / name) for name in ("replay", "noreplay")}
    for name, records in phases.items():
        print(f"## {name}: {len(records)} steps")
        for label, key in FIGURES.items():
            print(f"  {label:14s} {_mean(records, key):.4g}   per step: "
                  + " ".join(f"{r.get(key, math.nan):.4g}" for r in records))
        print(f"  peak_gpu_gb    {_peak_gb(out / name, records):.1f}")
    main_phase = "replay" if phases["replay"] else "noreplay"
    records = phases[main_phase]
    contexts = out / main_phase / "contexts.json"
    context_max = max(json.loads(contexts.read_text()).values(), default=0) if contexts.is_file() else 0
    peak = _peak_gb(out / main_phase, records)
    gap, gap_replay = _mean(phases["noreplay"], FIGURES["gap_mean"]), _mean(phases["replay"], FIGURES["gap_mean"])
    ratio = gap / gap_replay if gap_replay else math.nan
    print(
        f"gptoss20b: params_b={_params_b():.2f} lora_rank={_rank(out / main_phase)} steps={len(records)} "
        f"peak_gpu_gb={peak:.1f} rollout_tok_s={_mean(records, FIGURES['rollout_tok_s']):.0f} "
        f"train_tok_s={_mean(records, FIGURES['train_tok_s']):.0f} step_s={_mean(records, FIGURES['step_s']):.1f} "
        f"gap_mean={gap:.4g} gap_mean_replay={gap_replay:.4g} gap_ratio={ratio:.3g} "
        f"peak_vs_goal={peak / GOAL_GB:.2f} context_max={context_max}"
    )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python benchmarks/gptoss20b_report.py OUT_DIR")
    main(Path(sys.argv[1]))
