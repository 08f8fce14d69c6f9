"""One torchrun rank of the FSDP2 parity check (CPU/gloo in CI, CUDA/NCCL on the device machine).

Every rank samples its own episodes from the same tiny GPT-OSS (rollout on each rank, parameters
gathered by ``distributed.unsharded``), all episodes are gathered, and then:

- reference: every rank runs the single-process update (``run_update``) on a full unsharded copy of
  the initial model over *all* episodes;
- FSDP2: the sharded model runs the same update on *its own* episodes only.

Rank 0 writes ``{"ref": {...}, "fsdp": {...}, "param_max_abs_diff": ..., "step2_s": ...}`` to ``--out``: loss
and grad norm of both, the largest difference of any parameter after the optimizer step, and the wall
time of a second whole step (rollout + update of ``world x tasks_per_rank`` tasks) on one device vs sharded.

usage: torchrun --standalone --nproc_per_node=2 tests/_fsdp2_parity_worker.py --device cpu --out OUT.json
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import time

import torch
from omegaconf import OmegaConf

from agentrl.engines.base import SamplingParams
from agentrl.engines.transformers_engine import TransformersEngine
from agentrl.harmony.trajectory import Trajectory
from agentrl.models.tiny import tiny_gpt_oss
from agentrl.train import distributed
from agentrl.train.batch import collate
from agentrl.train.config import TrainConfig
from agentrl.train.update import run_update


def sample_episodes(model, *, tasks: int, n: int, prompt_len: int, new_tokens: int, vocab: int, seed: int):
    """``tasks`` x ``n`` single-action trajectories (sampled, then cut to unequal prefixes) with a synthetic
    reward that varies within groups."""
    engine = TransformersEngine(model, pad_token_id=0, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (prompt_len + g,), generator=gen).tolist() for g in range(tasks)]
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
    batch = [p for p in prompts for _ in range(n)]
    completions = asyncio.run(engine.generate(batch, sampling))
    out = []
    for i, (prompt, c) in enumerate(zip(batch, completions, strict=True)):  # a random prefix of each sample
        keep = int(torch.randint(1, len(c.token_ids) + 1, (), generator=gen))  # unequal lengths: non-zero loss
        ids = list(c.token_ids[:keep])
        traj = Trajectory(prompt_ids=prompt, response_ids=ids, response_mask=[1] * keep,
                          rollout_logprobs=list(c.logprobs[:keep]))
        traj.reward = float(sum(t % 5 for t in ids)) / (4 * keep)
        out.append((traj, i // n))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--tasks-per-rank", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=6)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    device = distributed.init(args.device)
    rank, world = distributed.rank(), distributed.world_size()
    dtype = getattr(torch, args.dtype)
    model = tiny_gpt_oss(num_layers=args.layers, hidden=args.hidden, vocab=args.vocab, heads=args.heads, kv_heads=2,
                         experts=args.experts, top_k=2, dtype=dtype, device=device, seed=0).train()
    reference = copy.deepcopy(model)
    cfg = OmegaConf.structured(TrainConfig(env="parity"))
    cfg.actor.micro_batch_size = args.micro_batch
    cfg.actor.lr = 1e-3

    distributed.shard(model)

    def sync() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def update(m, episodes):
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=cfg.actor.lr)
        batch = collate([t for t, _ in episodes], [g for _, g in episodes], 0).to(device)
        return run_update(model=m, optimizer=opt, batch=batch, cfg=cfg, temperature=1.0).metrics

    # step 1, parity: rollout on each rank (different prompts and lengths), the same episodes for both updates
    with distributed.unsharded(model):
        mine = sample_episodes(model, tasks=args.tasks_per_rank, n=args.group_size, prompt_len=5 + rank, vocab=args.vocab,
                               new_tokens=args.new_tokens + rank, seed=100 + rank)
    everyone = distributed.gather_objects([(t, rank * 1000 + g) for t, g in mine])
    ref_metrics = update(reference, everyone)  # single-process update, identical on every rank
    fsdp_metrics = distributed.average_metrics(update(model, [(t, rank * 1000 + g) for t, g in mine]))
    diff = 0.0
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        diff = max(diff, float((full.detach().float() - q.detach().float()).abs().max()))

    # step 2, timing: a whole step (rollout + update) of world x tasks_per_rank tasks, on one device vs sharded
    t0 = sync()
    batch_all = sample_episodes(reference, tasks=world * args.tasks_per_rank, n=args.group_size, prompt_len=5,
                                vocab=args.vocab, new_tokens=args.new_tokens, seed=7)
    t1 = sync()
    update(reference, batch_all)
    t2 = sync()
    with distributed.unsharded(model):
        mine = sample_episodes(model, tasks=args.tasks_per_rank, n=args.group_size, prompt_len=5, vocab=args.vocab,
                               new_tokens=args.new_tokens, seed=200 + rank)
    t3 = sync()
    update(model, mine)
    t4 = sync()
    times = distributed.gather_objects([(t3 - t2, t4 - t3)])
    if rank == 0:
        keys = ("actor/pg_loss", "actor/grad_norm", "actor/entropy")
        result = {
            "world": world,
            "device": str(device),
            "dtype": args.dtype,
            "params": sum(p.numel() for p in reference.parameters()),
            "episodes": len(everyone),
            "ref": {k: ref_metrics[k] for k in keys},
            "fsdp": {k: fsdp_metrics[k] for k in keys},
            "param_max_abs_diff": diff,
            "step2_s": {
                "single": {"rollout": t1 - t0, "update": t2 - t1, "total": t2 - t0},
                "fsdp": {"rollout": max(r for r, _ in times), "update": max(u for _, u in times),
                         "total": max(r + u for r, u in times)},
            },
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(json.dumps(result, indent=2))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
