"""One torchrun rank of the FSDP2 + LoRA check (CPU/gloo): ``tests/test_models_lora.py`` runs two.

Every rank builds the same tiny GPT-OSS and applies the same LoRA adapter (seeded), then:

- reference: a full unsharded copy runs the single-process update (``run_update``) over both ranks' rows;
- FSDP2: the model sharded by ``distributed.shard`` runs the same update on this rank's rows only;
- checkpoint: :class:`FSDP2Parallel` gathers the adapter (and the adapter's optimizer state), rank 0 writes it
  with ``save_checkpoint``; a fresh sharded model and a fresh single-process model both load it back.

Rank 0 writes ``{"ref", "fsdp", "adapter_max_abs_diff", "base_unchanged", "checkpoint_files", ...}`` to ``--out``.

usage: torchrun --standalone --nproc_per_node=2 tests/_fsdp2_lora_worker.py --out OUT.json --run-dir DIR
"""

from __future__ import annotations

import argparse
import copy
import json
import os

import torch
from _tiny_update import ragged_batch

from agentrl.models import lora
from agentrl.models.tiny import tiny_gpt_oss
from agentrl.train import distributed
from agentrl.train.checkpoint import load_checkpoint, save_checkpoint
from agentrl.train.config import build_config
from agentrl.train.parallel import FSDP2Parallel
from agentrl.train.update import batched_logprobs, run_update

SPEC = lora.LoraSpec(rank=4, alpha=8)


def lora_model():
    model = tiny_gpt_oss(num_layers=2, hidden=64, experts=4, top_k=2, vocab=100, seed=0).train()
    torch.manual_seed(1000 + distributed.rank())  # rank-dependent global RNG: the adapter must not depend on it
    lora.apply_lora(model, SPEC, seed=5)
    return model


def optimizer_for(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--run-dir", required=True)
    args = ap.parse_args()
    distributed.init("cpu")
    rank, world = distributed.rank(), distributed.world_size()
    cfg = build_config(["env=retool", "actor.grad_clip=1e9", "actor.lr=1e-2", "actor.micro_batch_size=2"])

    model = lora_model()
    with torch.no_grad():  # non-zero B, so the adapter shapes the forward and the gradients of A
        for name, p in lora.adapter_parameters(model):
            if "lora_B" in name:
                p.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    reference = copy.deepcopy(model)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    parallel = FSDP2Parallel()
    parallel.wrap(model)

    everyone = ragged_batch(6 * world, seed=3)
    everyone.rollout_log_probs = batched_logprobs(reference, everyone, micro_batch_size=64, chunk_size=1024,
                                                  temperature=1.0)
    mine = everyone.select(torch.arange(rank * 6, rank * 6 + 6))
    ref_metrics = run_update(model=reference, optimizer=optimizer_for(reference), batch=everyone, cfg=cfg,
                             temperature=1.0).metrics
    optimizer = optimizer_for(model)
    fsdp_metrics = distributed.average_metrics(run_update(model=model, optimizer=optimizer, batch=mine, cfg=cfg,
                                                          temperature=1.0).metrics)
    ref_params = dict(reference.named_parameters())
    diff = max(float((full(p) - ref_params[n]).abs().max()) for n, p in lora.adapter_parameters(model))
    base_unchanged = all(torch.equal(full(p), base_before[n]) for n, p in model.named_parameters()
                         if not p.requires_grad)

    state_model, state_optim, extra = parallel.checkpoint_states(model, optimizer)
    if parallel.is_main:
        save_checkpoint(args.run_dir, step=1, data_position=0, model=state_model, optimizer=state_optim, extra=extra)
    parallel.barrier()
    ckpt = os.path.join(args.run_dir, "checkpoints", "step_000001")
    trained = {n: full(p) for n, p in lora.adapter_parameters(model)}

    again = lora_model()
    parallel.wrap(again)
    parallel.load_checkpoint(ckpt, again, optimizer_for(again))
    reloaded_fsdp = all(torch.equal(full(p), trained[n]) for n, p in lora.adapter_parameters(again))
    single = lora_model()  # a single-process resume of the multi-process checkpoint
    load_checkpoint(ckpt, model=single, optimizer=optimizer_for(single))
    reloaded_single = all(torch.equal(p.detach(), trained[n]) for n, p in lora.adapter_parameters(single))

    if rank == 0:
        keys = ("actor/pg_loss", "actor/grad_norm")
        result = {
            "world": world,
            "trainable_only_adapter": all(("lora_" in n) == p.requires_grad for n, p in model.named_parameters()),
            "ref": {k: ref_metrics[k] for k in keys},
            "fsdp": {k: fsdp_metrics[k] for k in keys},
            "adapter_max_abs_diff": diff,
            "base_unchanged": base_unchanged,
            "checkpoint_files": sorted(os.listdir(ckpt)),
            "reloaded_equal_fsdp": reloaded_fsdp,
            "reloaded_equal_single_process": reloaded_single,
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
