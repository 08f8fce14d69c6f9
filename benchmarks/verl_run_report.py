"""Per-step figures of an `agentrl train` run directory (verl backend or embedded trainer), side by side.

For each step of each run (from ``RUN_DIR/metrics.jsonl``; step 0, the embedded trainer's evaluation,
is skipped):

- ``step_s`` (``timing_s/step``), steps/s (``1 / step_s``);
- tokens: verl's ``perf/total_num_tokens`` (prompt + response tokens of the batch); for the embedded
  trainer ``episodes x (prompt_length/mean + response_length/mean + response_length/env_tokens_mean)``
  with ``episodes = rollout.batch_size x rollout.n`` from the run's ``config.yaml``; tokens/s = tokens /
  ``step_s``;
- the time split: rollout = verl ``timing_s/gen`` / embedded ``timing_s/rollout``; train = verl
  ``timing_s/old_log_prob + timing_s/ref + timing_s/update_actor + timing_s/update_weights`` (the weight
  sync to the rollout included) / embedded ``timing_s/old_log_prob + timing_s/ref + timing_s/update_actor``;
  other = the rest of the step (checkpoints, rewards, advantages, data movement);
- the train-vs-rollout log-prob gap: ``rollout_corr/kl`` (mean of ``log p_rollout - log p_train`` over
  sampled tokens) and ``rollout_corr/k3_kl`` on both; verl also reports ``training/rollout_probs_diff_*``
  (|p_rollout - p_train| in probability) and the embedded trainer ``rollout_corr/logprob_abs_diff_*``;
- ``actor/grad_norm``, the loss (verl ``actor/loss``; embedded ``actor/pg_loss - entropy_coeff x
  actor/entropy``) and the mean reward ``critic/score/mean``.

Writes a Markdown report to stdout (tables, then means over steps 2.. so the first step's warm-up is
left out) and, with ``--line``, ends with the issue's summary line::

    verl_run: gpus=<n> steps=<n> resumed=<yes|no> step1_loss_rel_diff_vs_embedded=<x>

Usage: python benchmarks/verl_run_report.py --verl RUN_DIR [--embedded RUN_DIR] [--step1 step1.json]
           [--gpus N] [--resumed yes|no] [--line]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any


def _records(run_dir: str) -> list[dict[str, Any]]:
    by_step: dict[int, dict[str, Any]] = {}
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step) if s > 0]


def _num(record: dict[str, Any], *keys: str) -> float:
    total, seen = 0.0, False
    for key in keys:
        value = record.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            total += value
            seen = True
    return total if seen else float("nan")


def _episodes(run_dir: str) -> int:
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(os.path.join(run_dir, "config.yaml"))
    return int(cfg.rollout.batch_size) * int(cfg.rollout.n)


def _entropy_coeff(run_dir: str) -> float:
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(os.path.join(run_dir, "config.yaml"))
    return float(OmegaConf.select(cfg, "actor.entropy_coeff") or 0.0)


def step_rows(run_dir: str) -> list[dict[str, float]]:
    """One row of figures per training step (see module docstring)."""
    records = _records(run_dir)
    verl = any("perf/total_num_tokens" in r for r in records)
    episodes = None if verl else _episodes(run_dir)
    coeff = _entropy_coeff(run_dir)
    rows = []
    for r in records:
        step_s = _num(r, "timing_s/step")
        if verl:
            tokens = _num(r, "perf/total_num_tokens")
            rollout = _num(r, "timing_s/gen")
            train = _num(r, "timing_s/old_log_prob", "timing_s/ref", "timing_s/update_actor", "timing_s/update_weights")
            loss = _num(r, "actor/loss")
        else:
            per = _num(r, "prompt_length/mean") + _num(r, "response_length/mean") + _num(r, "response_length/env_tokens_mean")
            tokens = episodes * per
            rollout = _num(r, "timing_s/rollout")
            train = _num(r, "timing_s/old_log_prob", "timing_s/ref", "timing_s/update_actor")
            loss = _num(r, "actor/pg_loss") - coeff * _num(r, "actor/entropy")
        rows.append({
            "step": r["step"], "step_s": step_s, "steps_per_s": 1.0 / step_s if step_s > 0 else float("nan"),
            "tokens": tokens, "tokens_per_s": tokens / step_s if step_s > 0 else float("nan"),
            "rollout_s": rollout, "train_s": train, "other_s": step_s - rollout - train,
            "kl": _num(r, "rollout_corr/kl"), "k3_kl": _num(r, "rollout_corr/k3_kl"),
            "probs_diff_mean": _num(r, "training/rollout_probs_diff_mean"),
            "probs_diff_max": _num(r, "training/rollout_probs_diff_max"),
            "lp_abs_diff_mean": _num(r, "rollout_corr/logprob_abs_diff_mean"),
            "lp_abs_diff_max": _num(r, "rollout_corr/logprob_abs_diff_max"),
            "grad_norm": _num(r, "actor/grad_norm"), "loss": loss, "reward": _num(r, "critic/score/mean"),
        })
    return rows


COLUMNS = [("step", "{:.0f}"), ("step_s", "{:.2f}"), ("steps_per_s", "{:.3f}"), ("tokens", "{:.0f}"),
           ("tokens_per_s", "{:.0f}"), ("rollout_s", "{:.2f}"), ("train_s", "{:.2f}"), ("other_s", "{:.2f}"),
           ("kl", "{:.2e}"), ("k3_kl", "{:.2e}"), ("probs_diff_mean", "{:.2e}"), ("probs_diff_max", "{:.2e}"),
           ("lp_abs_diff_mean", "{:.2e}"), ("lp_abs_diff_max", "{:.2e}"), ("grad_norm", "{:.3g}"),
           ("loss", "{:.4g}"), ("reward", "{:.3f}")]


def table(rows: list[dict[str, float]]) -> str:
    used = [(k, f) for k, f in COLUMNS if any(not math.isnan(row[k]) for row in rows)]
    lines = ["| " + " | ".join(k for k, _ in used) + " |", "|" + "---|" * len(used)]
    for row in rows:
        lines.append("| " + " | ".join("" if math.isnan(row[k]) else f.format(row[k]) for k, f in used) + " |")
    return "\n".join(lines)


def summary(rows: list[dict[str, float]]) -> dict[str, float]:
    """Means over steps 2.. (all steps when there is only one)."""
    rest = rows[1:] or rows

    def mean(key: str) -> float:
        values = [row[key] for row in rest if not math.isnan(row[key])]
        return sum(values) / len(values) if values else float("nan")

    step_s = mean("step_s")
    out = {"steps": len(rows), "mean_step_s": step_s, "steps_per_s": 1.0 / step_s if step_s > 0 else float("nan"),
           "tokens_per_s": mean("tokens") / step_s if step_s > 0 else float("nan")}
    for key in ("rollout_s", "train_s", "other_s"):
        out[f"{key}_share"] = mean(key) / step_s if step_s > 0 else float("nan")
    for key in ("kl", "k3_kl", "probs_diff_mean", "lp_abs_diff_mean"):
        out[f"mean_{key}"] = mean(key)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verl", required=True)
    ap.add_argument("--embedded")
    ap.add_argument("--step1", help="JSON written by benchmarks/verl_step1_compare.py")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--resumed", choices=("yes", "no"), default="no")
    ap.add_argument("--line", action="store_true", help="end with the verl_run: summary line")
    args = ap.parse_args(argv)
    runs = [("verl", args.verl)] + ([("embedded", args.embedded)] if args.embedded else [])
    verl_rows: list[dict[str, float]] = []
    for name, run_dir in runs:
        rows = step_rows(run_dir)
        if name == "verl":
            verl_rows = rows
        print(f"## {name}: {run_dir}\n\n{table(rows)}\n")
        print(f"{name} means over steps 2..{len(rows)}: " + json.dumps(
            {k: (round(v, 6) if isinstance(v, float) else v) for k, v in summary(rows).items()}) + "\n")
    rel = float("nan")
    if args.step1:
        with open(args.step1, encoding="utf-8") as f:
            step1 = json.load(f)
        rel = float(step1["loss"]["rel_diff"])
        print("## step 1, verl vs embedded on identical inputs\n\n```\n" + json.dumps(step1, indent=2) + "\n```\n")
    if args.line:
        print(f"verl_run: gpus={args.gpus} steps={len(verl_rows)} resumed={args.resumed} "
              f"step1_loss_rel_diff_vs_embedded={rel:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
