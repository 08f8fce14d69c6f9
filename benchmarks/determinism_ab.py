"""A/B of ``deterministic=true`` (torch's deterministic algorithms on the CPU, :func:`agentrl.train.repro.deterministic_cpu`)
on the main job's update: SmolLM2-135M-Instruct, fp32, one ``run_update`` (one optimizer step, SGD at lr 0 so
that every repetition sees the same weights) on a fixed random batch of ROWS rows (200 prompt tokens, 60-140
response tokens), micro-batches of 8, at torch's default thread count. The two settings alternate, REPS times
each, so that a changing load on a shared machine hits both alike; wall and process CPU seconds are printed
per update, with the load average.

usage: python benchmarks/determinism_ab.py [--rows 8] [--reps 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from agentrl.harmony.trajectory import Trajectory
from agentrl.models.loading import load_model
from agentrl.train.batch import collate
from agentrl.train.config import build_config
from agentrl.train.update import run_update


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    model = load_model("smollm2-135m", device="cpu", dtype="float32", seed=0).model.train()
    g = torch.Generator().manual_seed(0)
    trajs = []
    for i in range(args.rows):
        prompt = torch.randint(100, 40000, (200,), generator=g).tolist()
        n = int(torch.randint(60, 140, (1,), generator=g))
        trajs.append(Trajectory(prompt_ids=prompt, response_ids=torch.randint(100, 40000, (n,), generator=g).tolist(),
                                response_mask=[1] * n, rollout_logprobs=[-3.0] * n, reward=float(i % 2)))
    batch = collate(trajs, [i // 4 for i in range(args.rows)])
    cfg = build_config(["env=retool"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    torch.utils.deterministic.fill_uninitialized_memory = False
    print(f"threads={torch.get_num_threads()} rows={args.rows}", flush=True)
    for rep in range(args.reps):
        for deterministic in (False, True):
            torch.use_deterministic_algorithms(deterministic)
            t0, c0 = time.perf_counter(), time.process_time()
            run_update(model=model, optimizer=optimizer, batch=batch, cfg=cfg, temperature=1.0)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            load = " ".join(open("/proc/loadavg").read().split()[:3])
            print(f"rep={rep} deterministic={deterministic} wall_s={wall:.2f} cpu_s={cpu:.2f} load={load}", flush=True)


if __name__ == "__main__":
    main()
