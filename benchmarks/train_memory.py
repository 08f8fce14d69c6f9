"""Peak RSS per phase of ``agentrl train`` (default: the README's main job, ``env=retool``), old code against new
(issue 26 §5: goal <= 8 GB).

    python benchmarks/train_memory.py --before /tmp/agentrl-main-918ee58 [--after .] [key=value ...]

Runs ``agentrl train env=retool <key=value ...>`` once per checkout, one after the other (never two at once),
each in a child process under :mod:`benchmarks.memory_phases` (``PYTHONPATH`` = the checkout), and prints a
table of the peak RSS of each phase (model load, evaluation, SFT data, SFT, rollout, update, checkpoint,
other) and of the sandbox workers. Extra ``key=value`` arguments shorten the run for a development box, e.g.
``eval.num_tasks=32 trainer.total_steps=2``; the quiet-box figure is the default command with none. A child
whose RSS passes ``--limit-gb`` is killed (its figures are then lower bounds). The last line is
``train_memory: peak_rss_gb_before=<a> peak_rss_gb_after=<b> peak_phase_after=<phase> args=<extra>``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
PHASES = ["model load", "evaluation", "sft data", "sft", "rollout", "update", "checkpoint", "other"]


def run(checkout: str, extra: list[str], work: str, label: str, limit_gb: float) -> dict:
    out = os.path.join(work, f"{label}.json")
    run_dir = os.path.join(work, f"run-{label}")
    env = {**os.environ, "PYTHONPATH": os.path.abspath(checkout), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, os.path.join(HERE, "memory_phases.py"), out, "--", "train", "env=retool",
           f"run_dir={run_dir}", "trainer.progress=false", *extra]
    with open(os.path.join(work, f"{label}.log"), "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        killed = threading.Event()

        def guard() -> None:
            while proc.poll() is None:
                try:
                    with open(f"/proc/{proc.pid}/status", encoding="ascii") as f:
                        rss = next(int(x.split()[1]) for x in f if x.startswith("VmRSS:"))
                except (OSError, StopIteration):
                    return
                if rss > limit_gb * 2**20:
                    killed.set()
                    os.killpg(proc.pid, signal.SIGKILL)
                    return
                killed.wait(0.3)

        threading.Thread(target=guard, daemon=True).start()
        code = proc.wait()
    report = json.load(open(out, encoding="utf-8")) if os.path.exists(out) else {"phases": {}, "peak_rss_gb": None}
    report.update(exit_code=code, killed_at_limit=killed.is_set(), log=os.path.join(work, f"{label}.log"))
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="checkout of the old code (e.g. a worktree of 918ee58); omit to skip")
    parser.add_argument("--after", default=os.path.dirname(HERE))
    parser.add_argument("--limit-gb", type=float, default=20.0)
    parser.add_argument("--workdir", help="keep reports, logs and runs here (default: a temporary directory)")
    parser.add_argument("extra", nargs="*", help="key=value overrides for agentrl train (none: the default run)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="train-memory-") as tmp:
        work = args.workdir or tmp
        os.makedirs(work, exist_ok=True)
        reports = {}
        for label, checkout in (("before", args.before), ("after", args.after)):
            if checkout:
                reports[label] = run(checkout, args.extra, work, label, args.limit_gb)
                r = reports[label]
                print(f"{label} ({checkout}): exit {r['exit_code']}, peak {r['peak_rss_gb']} GB, log {r['log']}", flush=True)
    labels = list(reports)
    print("| phase | " + " | ".join(f"{x} peak RSS GB | {x} workers GB | {x} s" for x in labels) + " |")
    print("|---|" + "---|---|---|" * len(labels))
    for phase in PHASES:
        cells = []
        for x in labels:
            p = reports[x]["phases"].get(phase)
            cells += ["-", "-", "-"] if p is None else [f"{p['peak_rss_gb']:.2f}", f"{p['children_gb']:.2f}", f"{p['seconds']:.0f}"]
        print(f"| {phase} | " + " | ".join(cells) + " |")

    def figure(label: str) -> str:
        r = reports.get(label)
        if r is None or r["peak_rss_gb"] is None:
            return "na"
        return (">=" if r["killed_at_limit"] else "") + f"{r['peak_rss_gb']:.2f}"

    after = reports.get("after", {}).get("phases", {})
    top = max(after, key=lambda k: after[k]["peak_rss_gb"]) if after else "na"
    print(f"train_memory: peak_rss_gb_before={figure('before')} peak_rss_gb_after={figure('after')} "
          f"peak_phase_after={top.replace(' ', '_')} args={','.join(args.extra) or 'default'}")
    return 0 if all(r["exit_code"] == 0 for r in reports.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
