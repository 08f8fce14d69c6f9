"""A short, fixed slice of the main job (``agentrl train env=retool``) with each phase timed, for any checkout.

    python benchmarks/main_job_phases.py [--checkout DIR] [--out DIR] [--label NAME] [-- extra key=value ...]

Runs the main job's config cut down with config keys only (no code change): 2 SFT steps, no evaluation
before training, a 32-task held-out evaluation after SFT, then 1 RL step (no evaluation after it). The job
runs in a child process under :mod:`benchmarks.memory_phases` with ``PYTHONPATH=<checkout>`` and the checkout
as its working directory, so an old commit (``git worktree add --detach DIR <commit>``) runs with the same
virtualenv and is measured the same way. Per phase (model load, sft data, sft, evaluation, rollout, update,
checkpoint, other) it reports wall seconds, CPU seconds of the trainer process (all threads) and peak RSS;
plus the trainer's own records (each SFT step's ``timing_s/sft_step``). On a shared machine compare CPU
seconds, and checkouts A/B interleaved in the same window: wall time there mostly measures the load.

OpenMP waiting: ``memory_phases`` imports torch before agentrl's CLI, so :mod:`agentrl.cpu_threads` sets
nothing in the child; this script sets ``GOMP_SPINCOUNT`` to agentrl's value for every checkout unless
``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is set (``OMP_NUM_THREADS=1`` takes waiting out of the comparison).

The last line::

    main_job_phases: label=<> sft_step_s=<a,b> sft_cpu_s=<> eval_s=<> eval_cpu_s=<> rollout_s=<> rollout_cpu_s=<> update_s=<> update_cpu_s=<> wall_s=<> cpu_s=<> peak_rss_gb=<> peak_phase=<>
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

#: the cut-down main job; every key exists in the config of 918ee58 (the recorded run) and later
SHORT_JOB = ["env=retool", "seed=0", "sft.steps=2", "trainer.total_steps=1", "eval.num_tasks=32",
             "eval.before=false", "eval.after=false", "trainer.progress=false", "trainer.tensorboard=false",
             "trainer.save_trajectories=false"]
SPIN_COUNT = "30000"  # agentrl.cpu_threads.SPIN_COUNT (not imported: this script runs any checkout)
PHASES = [("sft", "sft"), ("eval", "evaluation"), ("rollout", "rollout"), ("update", "update")]


def sft_steps(run_dir: Path) -> list[float]:
    """Each SFT step's ``timing_s/sft_step`` from the run's ``sft/metrics.jsonl``."""
    path = run_dir / "sft" / "metrics.jsonl"
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["timing_s/sft_step"] for r in records if "timing_s/sft_step" in r]


def summary_line(label: str, report: dict, steps: list[float], wall: float) -> str:
    phases = report.get("phases", {})
    fields = [f"label={label}", f"sft_step_s={','.join(f'{s:.1f}' for s in steps) or 'na'}"]
    for short, name in PHASES:
        entry = phases.get(name)
        wall_s = "na" if entry is None else f"{entry['seconds']:.1f}"
        cpu_s = "na" if entry is None else f"{entry['cpu_s']:.1f}"
        if short != "sft":
            fields.append(f"{short}_s={wall_s}")
        fields.append(f"{short}_cpu_s={cpu_s}")
    cpu = sum(e.get("cpu_s", 0.0) for e in phases.values())
    peak_phase = max(phases, key=lambda k: phases[k]["peak_rss_gb"]) if phases else "na"
    fields += [f"wall_s={wall:.0f}", f"cpu_s={cpu:.0f}", f"peak_rss_gb={report.get('peak_rss_gb', 0.0):.2f}",
               f"peak_phase={peak_phase.replace(' ', '_')}"]
    return "main_job_phases: " + " ".join(fields)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", type=Path, default=ROOT, help="the repository to run (default: this one)")
    parser.add_argument("--out", type=Path, help="work directory (default: a fresh temporary one)")
    parser.add_argument("--label", default=None, help="name on the summary line (default: the checkout's commit)")
    args = parser.parse_args(argv[:cut])
    checkout = args.checkout.resolve()
    label = args.label or subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"],
                                         capture_output=True, text=True).stdout.strip()
    work = args.out or Path(tempfile.mkdtemp(prefix="main_job_phases_"))
    work.mkdir(parents=True, exist_ok=True)
    run_dir, report_path = work / "run", work / "phases.json"
    command = [sys.executable, str(HERE / "memory_phases.py"), str(report_path), "--", "train", *SHORT_JOB,
               f"run_dir={run_dir}", *argv[cut + 1:]]
    env = dict(os.environ, PYTHONPATH=str(checkout))
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env["GOMP_SPINCOUNT"] = SPIN_COUNT
    print("running:", " ".join(command[1:]), f"(PYTHONPATH={checkout})", flush=True)
    t0 = time.perf_counter()
    with open(work / "train.log", "w", encoding="utf-8") as log:
        subprocess.run(command, cwd=checkout, env=env, check=True, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    report = json.loads(report_path.read_text())
    for name, entry in sorted(report.get("phases", {}).items()):
        print(f"{name}: wall {entry['seconds']:.1f} s, cpu {entry['cpu_s']:.1f} s, peak rss {entry['peak_rss_gb']:.2f} GB")
    print(summary_line(label, report, sft_steps(run_dir), wall))
    return 0


if __name__ == "__main__":
    sys.exit(main())
