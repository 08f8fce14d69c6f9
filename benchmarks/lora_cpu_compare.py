"""LoRA against full fine-tuning on the embedded default (issue 21): ``agentrl train env=retool`` twice on the same
box, once as it is and once with ``actor.lora.rank=RANK`` (its learning rates then default to 10x: actor.lr 1e-4,
sft.lr 5e-4), one after the other. Measures each run's wall time, peak RSS (the largest process of the run:
``ru_maxrss`` of its children, as ``/usr/bin/time -v`` reports it) and held-out reward after SFT and after RL
(``summary.json``).

    python benchmarks/lora_cpu_compare.py OUT_DIR [--rank 16] [key=value ...]   # extra keys go to both runs

Prints one line per run, then the summary line last:
``lora_cpu: wall_s_full=<> wall_s_lora=<> rss_gb_full=<> rss_gb_lora=<> after_sft_full=<> after_sft_lora=<>
after_full=<> after_lora=<> wall_ratio=<lora/full> rss_ratio=<lora/full>``. The full default takes ~17 minutes
and up to 16 GB on a 2-core box: run it on a quiet machine (the two runs take ~35 minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

_MEASURE = (
    "import resource, subprocess, sys\n"
    "code = subprocess.run(sys.argv[1:]).returncode\n"
    "print('peak_rss_kb', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, flush=True)\n"
    "sys.exit(code)\n"
)


def run_variant(out: str, name: str, keys: list[str]) -> dict[str, float]:
    """``agentrl train env=retool KEYS`` into ``OUT/NAME``; its wall seconds, peak RSS (GB) and held-out means."""
    run_dir = os.path.join(out, name)
    argv = [sys.executable, "-m", "agentrl.cli", "train", "env=retool", f"run_dir={run_dir}", "overwrite=true", *keys]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _MEASURE, *argv], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    with open(os.path.join(out, f"{name}.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode:
        raise SystemExit(f"{name}: agentrl train exited {proc.returncode}; see {out}/{name}.log")
    rss_kb = next(int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("peak_rss_kb"))
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    figures = {"wall_s": wall, "rss_gb": rss_kb / 1024**2,
               "after_sft": summary.get("eval_after_sft", {}).get("mean", float("nan")),
               "after": summary.get("eval_after", {}).get("mean", float("nan"))}
    print(f"{name}: " + " ".join(f"{k}={v:.3f}" for k, v in figures.items()) + f" ({' '.join(keys) or 'defaults'})",
          flush=True)
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--rank", type=int, default=16, help="actor.lora.rank of the LoRA run (alpha: 2 * rank)")
    ap.add_argument("keys", nargs="*", help="extra key=value overrides for both runs")
    args = ap.parse_intermixed_args()
    os.makedirs(args.out, exist_ok=True)
    full = run_variant(args.out, "full", args.keys)
    lora = run_variant(args.out, "lora", [f"actor.lora.rank={args.rank}", *args.keys])
    fields = {f"{k}_{tag}": v[k] for k in ("wall_s", "rss_gb", "after_sft", "after") for tag, v in
              (("full", full), ("lora", lora))}
    fields["wall_ratio"] = lora["wall_s"] / full["wall_s"]
    fields["rss_ratio"] = lora["rss_gb"] / full["rss_gb"]
    print("lora_cpu: " + " ".join(f"{k}={v:.3g}" for k, v in fields.items()))


if __name__ == "__main__":
    main()
