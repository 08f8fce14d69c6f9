"""Paired A/B of the sandbox pool's cost per execution: this tree against a baseline tree (e.g. main).

Each side runs in its own process, with its own tree on ``PYTHONPATH``, one warm ``LocalSandbox`` of
``--workers`` workers. The two alternate in blocks of ``--runs`` trivial stateless runs (``--in-flight`` at a
time), so that load from other processes falls on both alike. Per block each side reports the CPU seconds of
every process of its sandboxes (the worker, its children and their reaped children), the CPU of its own host
process, and the wall time. Medians over ``--blocks`` blocks are compared; the per-block pairing is what makes the
figure usable on a shared machine, where each side alone varies by 10-20 % from block to block.

Every output is checked. The last line is the summary:
``sandbox_ab: cpu_ms_per_exec=<this> baseline=<baseline> ratio=<this/baseline> paired_diff_ms=<median of
per-block differences> exec_per_s=<this> baseline_exec_per_s=<baseline> throughput_ratio=<this/baseline>``.

Usage: ``python benchmarks/sandbox_ab.py --baseline /tmp/main-tree [--blocks 20] [--runs 300]``; make the baseline
tree with ``git archive main | tar -x -C /tmp/main-tree``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

#: The side process: one warm pool; for every line on stdin, one block; one JSON line per block on stdout.
SIDE = r"""
import asyncio, json, os, sys, time
from agentrl.envs.sandbox.cgroups import descendants
from agentrl.envs.sandbox.local import LocalSandbox

def tree_cpu(sb):
    total = 0.0
    for w in sb._workers:
        if w.proc is None:
            continue
        for pid in descendants(w.proc.pid):
            try:
                stat = open(f"/proc/{pid}/stat", "rb").read()
            except OSError:
                continue
            total += sum(int(v) for v in stat[stat.rindex(b")") + 2 :].split()[11:15])
    return total / os.sysconf("SC_CLK_TCK")

async def main(workers, runs, in_flight):
    async with LocalSandbox(workers=workers) as sb:
        for _ in sys.stdin:
            left = runs
            async def client():
                nonlocal left
                while left > 0:
                    left -= 1
                    r = await sb.run("print(1 + 1)", timeout_s=5)
                    assert r.ok and r.stdout == "2\n", r
            cpu0, host0, t0 = tree_cpu(sb), os.times(), time.perf_counter()
            await asyncio.gather(*(client() for _ in range(in_flight)))
            host1 = os.times()
            print(json.dumps({
                "sandbox_cpu_s": tree_cpu(sb) - cpu0,
                "host_cpu_s": host1.user + host1.system - host0.user - host0.system,
                "wall_s": time.perf_counter() - t0,
            }), flush=True)

asyncio.run(main(*map(int, sys.argv[1:4])))
"""


def start_side(tree: Path, args: argparse.Namespace) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    argv = [sys.executable, "-c", SIDE, str(args.workers), str(args.runs), str(args.in_flight)]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=tree)


def block(side: subprocess.Popen) -> dict:
    assert side.stdin is not None and side.stdout is not None
    side.stdin.write("go\n")
    side.stdin.flush()
    line = side.stdout.readline()
    if not line:
        raise RuntimeError("a side of the A/B stopped; see its error output above")
    return json.loads(line)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", type=Path, required=True, help="root of the baseline tree (e.g. main)")
    p.add_argument("--blocks", type=int, default=20)
    p.add_argument("--runs", type=int, default=300, help="runs per block")
    p.add_argument("--in-flight", type=int, default=4)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args(argv)
    this = Path(__file__).resolve().parents[1]
    sides = {"this": start_side(this, args), "baseline": start_side(args.baseline.resolve(), args)}
    results: dict[str, list[dict]] = {name: [] for name in sides}
    try:
        for name in sides:  # warm-up, not counted
            block(sides[name])
        for i in range(args.blocks):
            order = list(sides) if i % 2 == 0 else list(reversed(sides))
            for name in order:
                results[name].append(block(sides[name]))
    finally:
        for side in sides.values():
            side.stdin.close()
            side.wait(timeout=60)

    def per_exec_ms(r: dict) -> float:
        return 1000 * (r["sandbox_cpu_s"] + r["host_cpu_s"]) / args.runs

    cpu = {name: [per_exec_ms(r) for r in rs] for name, rs in results.items()}
    rate = {name: [args.runs / r["wall_s"] for r in rs] for name, rs in results.items()}
    diffs = [a - b for a, b in zip(cpu["this"], cpu["baseline"], strict=True)]
    for name in sides:
        print(
            f"{name}: CPU ms per execution (sandboxes + host process) median {statistics.median(cpu[name]):.3f}, "
            f"blocks: {' '.join(f'{c:.2f}' for c in cpu[name])}; exec/s median {statistics.median(rate[name]):.0f}"
        )
    print(json.dumps({"load_1min": os.getloadavg()[0], "blocks": args.blocks, "runs": args.runs}))
    this_cpu, base_cpu = statistics.median(cpu["this"]), statistics.median(cpu["baseline"])
    this_rate, base_rate = statistics.median(rate["this"]), statistics.median(rate["baseline"])
    print(
        f"sandbox_ab: cpu_ms_per_exec={this_cpu:.3f} baseline={base_cpu:.3f} ratio={this_cpu / base_cpu:.3f} "
        f"paired_diff_ms={statistics.median(diffs):+.3f} exec_per_s={this_rate:.0f} "
        f"baseline_exec_per_s={base_rate:.0f} throughput_ratio={this_rate / base_rate:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
