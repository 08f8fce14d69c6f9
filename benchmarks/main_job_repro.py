"""Bit-identical re-runs of the main job: two runs of ``agentrl train env=retool`` with one seed on one machine
must give identical ``metrics.jsonl`` (timing keys aside) and identical final checkpoints.

    python benchmarks/main_job_repro.py --out DIR [--seed 0] [-- extra key=value ...]   # runs the job twice
    python benchmarks/main_job_repro.py RUN_A RUN_B                                       # compares two runs

With ``--out`` the README's main-job command runs twice, one run after the other, into ``DIR/a`` and ``DIR/b``
(each about 17 minutes on the quiet 2-core box; keys after ``--`` are added to both, e.g. a smaller config for a
check). The comparison is :func:`agentrl.train.repro.differing_keys`: every metric of every step except
wall times and rates (``timing_s/*``, ``perf/*``, ``*latency_s*``), and every tensor of the latest checkpoint's
model and optimizer state, bit for bit. Prints the differing keys (at most 20), then last:
``main_job_repro: identical=<yes|no> differing_keys=<n>``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from agentrl.train.repro import differing_keys

ROOT = Path(__file__).resolve().parents[1]


def run_main_job(run_dir: Path, seed: int, extra: list[str]) -> None:
    """``agentrl train env=retool`` (the README's main job) into ``run_dir``; raises on a failed run."""
    command = [sys.executable, "-m", "agentrl.cli", "train", "env=retool", f"seed={seed}", f"run_dir={run_dir}",
               "trainer.progress=false", *extra]
    print("running:", " ".join(command[2:]), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The script's arguments, and the ``key=value`` overrides after ``--`` (added to every run)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    return parser.parse_args(argv[:cut]), argv[cut + 1 :]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", help="two run directories to compare (instead of --out)")
    parser.add_argument("--out", type=Path, help="run the main job twice into OUT/a and OUT/b")
    parser.add_argument("--seed", type=int, default=0)
    args, extra = parse(parser, argv)
    if args.out is not None:
        runs = [args.out / "a", args.out / "b"]
        for run in runs:
            run_main_job(run, args.seed, extra)
    elif len(args.runs) == 2 and not extra:
        runs = [Path(r) for r in args.runs]
    else:
        parser.error("give two run directories, or --out DIR to run the main job twice")
    differing = differing_keys(*runs)
    for key in differing[:20]:
        print("differs:", key)
    print(f"main_job_repro: identical={'no' if differing else 'yes'} differing_keys={len(differing)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
