"""A gain that holds: the main job's RL gain over three seeds, each against its own noise.

    python benchmarks/main_job_seeds.py --out DIR [--seeds 0 1 2] [-- extra key=value ...]   # runs them
    python benchmarks/main_job_seeds.py RUN_1 RUN_2 RUN_3                                    # reads runs

With ``--out`` the README's main-job command (``agentrl train env=retool``) runs once per seed, one after the
other, into ``DIR/seed<S>`` (each about 17 minutes on the quiet 2-core box). From each run's ``summary.json``:
the RL gain ``eval_after.mean - eval_after_sft.mean`` (held-out reward after RL minus after the cold start, on
the same held-out tasks), its noise ``max(eval_after_sft.sem, eval_after.sem)``, the peak RSS of the trainer
(``peak_rss_gb``, or of a child process when larger) and the wall time of the run (``wall_s_this_process``).
A run that did not complete (``complete: false``) is reported and counts as failing the goals.

Where the tasks carry an operation (``task["op"]``, as the retool generator's do), each run also gets a line
that says where its gain came from: the held-out reward per operation after SFT and after RL, and per operation
the training groups whose samples all got one reward (zero GRPO advantage, so no gradient for that task), e.g.
``count_multiples 0.60->0.10 (n=20, flat groups 11/15)``.

Prints one line per run, whether the goals hold (each gain >= 2 x its sem, mean gain >= 0.10, peak RSS <= 8 GB,
wall <= 1200 s), then last:
``main_job_seeds: gains=<g1,g2,g3> sems=<s1,s2,s3> mean_gain=<x> peak_rss_gb=<max> wall_s=<max>``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from main_job_repro import parse, run_main_job

from agentrl.rundir import EVAL_TRAJECTORIES, TrainRun

GOALS = {"gain_over_sem": 2.0, "mean_gain": 0.10, "peak_rss_gb": 8.0, "wall_s": 1200.0}


def read_run(run: Path) -> dict[str, float | bool]:
    """The figures of one run (module docstring) from its ``summary.json``."""
    summary = json.loads((run / "summary.json").read_text())
    sft, after = summary.get("eval_after_sft"), summary.get("eval_after")
    if sft is None or after is None:
        raise SystemExit(f"{run}: summary.json has no eval_after_sft / eval_after (a run with SFT and evaluation?)")
    return {
        "gain": after["mean"] - sft["mean"], "sem": max(sft["sem"], after["sem"]),
        "peak_rss_gb": max(summary.get("peak_rss_gb", float("nan")), summary.get("peak_rss_children_gb", 0.0)),
        "wall_s": summary["wall_s_this_process"], "complete": bool(summary.get("complete", False)),
    }


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def by_operation(run: Path) -> str:
    """The per-operation line of one run (module docstring); empty when its tasks carry no ``op``."""
    paths, summary = TrainRun(run), json.loads((run / "summary.json").read_text())
    held_out: dict[str, list[list[float]]] = {}
    for i, label in enumerate(("after_sft", f"step_{summary['eval_after']['step']:06d}")):
        for r in _records(paths.evaluation(label) / EVAL_TRAJECTORIES):
            held_out.setdefault(r["task"].get("op"), [[], []])[i].append(float(r["reward"]))
    groups: dict[str, list[int]] = {}
    for step in range(1, int(summary["eval_after"]["step"]) + 1):
        rewards: dict[tuple[str, str], set[float]] = {}
        for r in _records(paths.step_trajectories(step)):
            rewards.setdefault((r["task"].get("op"), r["task"]["id"]), set()).add(float(r["reward"]))
        for (op, _), seen in rewards.items():
            flat, total = groups.setdefault(op, [0, 0])
            groups[op] = [flat + (len(seen) == 1), total + 1]
    if None in held_out:
        return ""
    parts = []
    for op, (sft, after) in sorted(held_out.items()):
        flat, total = groups.get(op, (0, 0))
        parts.append(f"{op} {sum(sft) / len(sft):.2f}->{sum(after) / len(after):.2f} "
                     f"(n={len(sft)}, flat groups {flat}/{total})")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", type=Path, help="run directories to read (instead of --out)")
    parser.add_argument("--out", type=Path, help="run the main job once per seed into OUT/seed<S>")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args, extra = parse(parser, argv)
    if args.out is not None:
        runs = [args.out / f"seed{s}" for s in args.seeds]
        for seed, run in zip(args.seeds, runs, strict=True):
            run_main_job(run, seed, extra)
    elif args.runs and not extra:
        runs = args.runs
    else:
        parser.error("give run directories, or --out DIR to run the main job per seed")
    figures = [read_run(r) for r in runs]
    for run, f in zip(runs, figures, strict=True):
        print(f"{run}: gain {f['gain']:.3f} sem {f['sem']:.3f} peak_rss_gb {f['peak_rss_gb']:.2f} "
              f"wall_s {f['wall_s']:.0f} complete {'yes' if f['complete'] else 'no'}")
        if f["complete"] and (ops := by_operation(run)):
            print(f"  by operation: {ops}")
    mean_gain = sum(f["gain"] for f in figures) / len(figures)
    rss, wall = max(f["peak_rss_gb"] for f in figures), max(f["wall_s"] for f in figures)
    held = all(f["complete"] and f["gain"] >= GOALS["gain_over_sem"] * f["sem"] for f in figures)
    print(f"goals: each gain >= 2 x sem {'yes' if held else 'no'}, mean_gain >= 0.10 "
          f"{'yes' if mean_gain >= GOALS['mean_gain'] else 'no'}, peak_rss_gb <= 8 {'yes' if rss <= 8 else 'no'}, "
          f"wall_s <= 1200 {'yes' if wall <= GOALS['wall_s'] else 'no'}")
    gains = ",".join(f"{f['gain']:.3f}" for f in figures)
    sems = ",".join(f"{f['sem']:.3f}" for f in figures)
    print(f"main_job_seeds: gains={gains} sems={sems} mean_gain={mean_gain:.3f} peak_rss_gb={rss:.2f} wall_s={wall:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
