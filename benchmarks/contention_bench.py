"""Graceful under contention: CPU-seconds per evaluated episode of ``agentrl eval``, quiet vs beside a load.

The work is the embedded default's held-out evaluation at a smaller size: ``agentrl eval env=retool
model=smollm2-135m`` on 32 held-out retool tasks, greedy, up to 2 turns of at most 64 new tokens each,
every episode in flight at once (``concurrency=32``), with the local code sandbox. It runs once on the
machine as it is ("quiet") and once beside a reproducible competing load, ``stress-ng --cpu N`` at nice 19
(N = the CPUs this process may use, 2 on the reference box). The CPU-seconds are user + sys of the eval
process and everything it waited for (its sandbox workers included: ``os.wait4`` on the eval process);
the load's own CPU is not counted. A per-episode figure that stays flat under load means the work costs
the same CPU and only waits longer for it; the goal is loaded <= 1.5 x quiet.

Both runs use agentrl's thread settings (:mod:`agentrl.cpu_threads`: torch's OpenMP threads spin
``GOMP_SPINCOUNT=30000``, a tenth of libgomp's default, before they sleep). With ``--baseline`` (the default) the same two runs are repeated with ``GOMP_SPINCOUNT=300000``,
libgomp's own default spinning (a real setting: a user who sets ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY``
keeps it), which is what agentrl did before; ``--no-baseline`` skips them.

    python benchmarks/contention_bench.py [--tasks 32] [--load-cpus N] [--no-baseline]

Prints one line per run, the baseline's summary, and last:
``contention: cpu_s_per_episode_quiet=<a> cpu_s_per_episode_loaded=<b> ratio=<b/a>``.
Timings depend on the machine and on whatever else runs on it: measure on an otherwise idle box.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agentrl.cpu_threads import available_cpus

ROOT = Path(__file__).resolve().parents[1]
#: libgomp's spin count when no wait policy is set (its documented default): agentrl's behaviour before
SPINNING = {"GOMP_SPINCOUNT": "300000"}


def eval_command(tasks: int, out: Path) -> list[str]:
    """``agentrl eval`` of the embedded default's evaluation settings on ``tasks`` held-out retool tasks."""
    return [
        sys.executable, "-m", "agentrl.cli", "eval", "env=retool", "model=smollm2-135m", f"limit={tasks}",
        "temperature=0", "max_new_tokens=64", "env.max_turns=2", f"concurrency={tasks}", f"out={out}",
        "overwrite=true", "progress=false",
    ]


def start_load(cpus: int) -> subprocess.Popen:
    """``stress-ng --cpu <cpus>`` at nice 19, in its own process group (stopped by :func:`stop_load`)."""
    if shutil.which("stress-ng") is None:
        sys.exit("contention_bench: stress-ng is not installed; apt-get install -y stress-ng")
    return subprocess.Popen(["nice", "-n", "19", "stress-ng", "--cpu", str(cpus), "--timeout", "3600"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def stop_load(load: subprocess.Popen) -> None:
    os.killpg(load.pid, signal.SIGTERM)
    load.wait(timeout=30)


def run_eval(tasks: int, extra_env: dict[str, str], label: str) -> dict[str, float]:
    """One ``agentrl eval`` run; returns its episodes, wall seconds and CPU-seconds (user + sys of the tree)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(extra_env)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory(prefix="contention-") as tmp:
        out = Path(tmp) / "eval"
        t0 = time.perf_counter()
        proc = subprocess.Popen(eval_command(tasks, out), env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        stderr = proc.stderr.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            sys.exit(f"contention_bench: agentrl eval failed ({label}, exit {proc.returncode}):\n{stderr[-2000:]}")
        run = json.loads((out / "metrics.json").read_text())["run"]
    episodes = run["episodes_run"]
    if episodes != tasks:
        sys.exit(f"contention_bench: {label}: {episodes} of {tasks} episodes finished ({run})")
    cpu = usage.ru_utime + usage.ru_stime
    row = {"episodes": episodes, "wall_s": wall, "cpu_s": cpu, "cpu_s_per_episode": cpu / episodes,
           "voluntary_switches": usage.ru_nvcsw, "involuntary_switches": usage.ru_nivcsw}
    print(f"{label}: episodes={episodes} wall_s={wall:.1f} cpu_s={cpu:.1f} cpu_s_per_episode={cpu / episodes:.3f} "
          f"voluntary_switches={usage.ru_nvcsw} involuntary_switches={usage.ru_nivcsw}", flush=True)
    return row


def quiet_and_loaded(tasks: int, load_cpus: int, extra_env: dict[str, str], name: str) -> tuple[float, float]:
    quiet = run_eval(tasks, extra_env, f"{name} quiet")
    load = start_load(load_cpus)
    try:
        loaded = run_eval(tasks, extra_env, f"{name} loaded (stress-ng --cpu {load_cpus}, nice 19)")
    finally:
        stop_load(load)
    return quiet["cpu_s_per_episode"], loaded["cpu_s_per_episode"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=32, help="held-out retool tasks per run")
    ap.add_argument("--load-cpus", type=int, default=available_cpus(), help="stress-ng --cpu N")
    ap.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                    help="also run with libgomp's default spinning (GOMP_SPINCOUNT=300000), agentrl's old behaviour")
    args = ap.parse_args()
    if args.baseline:
        a, b = quiet_and_loaded(args.tasks, args.load_cpus, SPINNING, "baseline (GOMP_SPINCOUNT=300000)")
        print(f"contention_baseline: cpu_s_per_episode_quiet={a:.3f} cpu_s_per_episode_loaded={b:.3f} ratio={b / a:.2f}")
    a, b = quiet_and_loaded(args.tasks, args.load_cpus, {}, "agentrl")
    print(f"contention: cpu_s_per_episode_quiet={a:.3f} cpu_s_per_episode_loaded={b:.3f} ratio={b / a:.2f}")


if __name__ == "__main__":
    main()
