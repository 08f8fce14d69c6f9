"""Asynchronous rollouts against the synchronous trainer (issue 33): the same recipe, the same number of RL steps,
with ``rollout.max_staleness`` 0 (synchronous), 1 and 2.

    python benchmarks/async_bench.py --out DIR [--gpu] [--steps N] [-- extra key=value ...]

``--gpu``: the GPU retool recipe (``examples/train_gpu_retool.sh``'s keys: SmolLM2-135M, retool tier=mixed, 3 turns,
8x8 episodes per step) on ``device=cuda``; without it the CPU default (``agentrl train env=retool``). Every run
uses the decode engine (``rollout.engine=decode``, the GPU default), so the speedup is that of overlapping
rollout and update alone, and token-level TIS (``algorithm.rollout_correction.rollout_is=token``, threshold 2),
which the staleness-0 run applies too (there behaviour and proximal policies agree up to the engine's numerics).
Keys after ``--`` go to every run (e.g. a smaller config for a check). The SFT stage is the same work in every
run; to do it once, train it first (``agentrl sft env=retool run_dir=SFT ...``) and pass ``model=SFT
sft.steps=0`` after ``--``.

Per run, from its ``metrics.jsonl``, ``trajectories/`` and ``summary.json``: ``rl_s``, the RL stage's wall time (the
sum of ``timing_s/step``; the SFT stage and the evaluations are the same work in every run and left out),
``tokens_per_s``, model tokens trained per second of it, and the held-out reward after the last step
(``eval_after``: mean and sem). Prints one line per run, then last:
``async: speedup_s1=<sync rl_s / s1 rl_s> speedup_s2=<...> heldout_sync=<> heldout_s1=<> heldout_s2=<>``.
The goals (issue 33): speedup_s1 >= 1.3 on the GPU, held-out reward within 2 sem of the synchronous run's.
Timings depend on the machine and on whatever else runs on it: measure on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: ``examples/train_gpu_retool.sh``'s keys (its plot and sandbox choice aside)
GPU_RECIPE = ["device=cuda", "env_kwargs.tier=mixed", "rollout.max_turns=3", "rollout.max_new_tokens=192",
              "rollout.batch_size=8", "rollout.n=8", "rollout.temperature=0.8", "actor.lr=2e-5", "sft.steps=4",
              "sft.num_demos=64", "sft.batch_size=16", "sft.micro_batch_size=16", "eval.num_tasks=128"]
#: what every run shares: the engine asynchronous rollouts need and the decoupled loss's correction
COMMON = ["rollout.engine=decode", "algorithm.rollout_correction.rollout_is=token",
          "algorithm.rollout_correction.rollout_is_threshold=2.0", "trainer.save_every=0", "trainer.max_wall_s=0",
          "eval.every=0", "trainer.progress=false"]


def run(run_dir: Path, staleness: int, steps: int, gpu: bool, extra: list[str]) -> dict[str, float]:
    """One ``agentrl train env=retool`` run into ``run_dir``; returns its figures (module docstring)."""
    command = [sys.executable, "-m", "agentrl.cli", "train", "env=retool", f"run_dir={run_dir}",
               f"trainer.total_steps={steps}", f"rollout.max_staleness={staleness}", *COMMON,
               *(GPU_RECIPE if gpu else []), *extra]
    print("running:", " ".join(command[3:]), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)
    return figures(run_dir)


def figures(run_dir: Path) -> dict[str, float]:
    """``rl_s``, ``tokens_per_s``, ``heldout`` and ``heldout_sem`` of a finished run."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl_s = sum(r.get("timing_s/step", 0.0) for r in records if r["step"] > 0)
    tokens = 0
    for path in sorted((run_dir / "trajectories").glob("step_*.jsonl")):
        for line in path.read_text().splitlines():
            traj = json.loads(line)
            if traj.get("train_logprobs") is not None:  # trained on
                tokens += sum(traj["response_mask"])
    after = json.loads((run_dir / "summary.json").read_text()).get("eval_after", {})
    return {"rl_s": rl_s, "tokens_per_s": tokens / rl_s if rl_s else float("nan"),
            "heldout": after.get("mean", float("nan")), "heldout_sem": after.get("sem", float("nan"))}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="directory of the three runs")
    parser.add_argument("--gpu", action="store_true", help="the GPU retool recipe (else the CPU default)")
    parser.add_argument("--steps", type=int, default=30, help="RL steps of every run")
    args, extra = parser.parse_args(argv[:cut]), argv[cut + 1 :]
    results = {}
    for staleness in (0, 1, 2):
        results[staleness] = r = run(args.out / f"s{staleness}", staleness, args.steps, args.gpu, extra)
        print(f"max_staleness={staleness}: rl_s={r['rl_s']:.1f} tokens_per_s={r['tokens_per_s']:.1f} "
              f"heldout={r['heldout']:.3f}±{r['heldout_sem']:.3f}", flush=True)
    sync = results[0]["rl_s"]
    print(f"async: speedup_s1={sync / results[1]['rl_s']:.2f} speedup_s2={sync / results[2]['rl_s']:.2f} "
          f"heldout_sync={results[0]['heldout']:.3f} heldout_s1={results[1]['heldout']:.3f} "
          f"heldout_s2={results[2]['heldout']:.3f}")


if __name__ == "__main__":
    main()
