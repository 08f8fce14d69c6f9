"""One torchrun rank of the Ulysses sink-attention check (CPU/gloo): verl's all-to-all + our sink slicing.

Each rank holds a contiguous sequence chunk of q, k, v (all heads) and position ids, and the full sink
vector; ``ulysses_attention`` must return that chunk of the full-sequence attention output, and the
sink gradients summed over ranks must equal the full-sequence sink gradient. Rank 0 writes the errors.

usage: torchrun --standalone --nproc_per_node=2 tests/_ulysses_worker.py OUT.json HKV [HKV ...]
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from verl.utils.ulysses import set_ulysses_sequence_parallel_group

from agentrl.kernels import sink_attention_reference
from agentrl.train.verl_backend.ulysses import ulysses_attention


def inner(module, query, key, value, attention_mask, *args, s_aux=None, position_ids=None, **kwargs):
    """transformers-style attention over [B, H, S, D] with per-head sinks (the float64 reference)."""
    assert query.shape[1] == s_aux.shape[0], "sinks must match the local heads"
    return sink_attention_reference(query, key, value, s_aux, causal=True).transpose(1, 2), None


def check(hkv: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    b, hq, s, d = 2, 4, 12, 16
    q, k, v = torch.randn(b, hq, s, d), torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
    sinks = torch.randn(hq)
    grad_out = torch.randn(b, s, hq, d)

    full_sinks = sinks.clone().requires_grad_()
    full, _ = inner(None, q, k, v, None, s_aux=full_sinks)
    (full * grad_out).sum().backward()

    chunk = slice(rank * s // world, (rank + 1) * s // world)
    local_sinks = sinks.clone().requires_grad_()
    attention = ulysses_attention(inner)
    pos = torch.arange(s)[None, chunk].expand(b, -1).contiguous()
    out, _ = attention(None, q[:, :, chunk], k[:, :, chunk], v[:, :, chunk], None, s_aux=local_sinks,
                       position_ids=pos)
    (out * grad_out[:, chunk]).sum().backward()
    dsink = local_sinks.grad.clone()
    dist.all_reduce(dsink)
    errors = torch.tensor([float((out - full[:, chunk]).abs().max().detach()), float((dsink - full_sinks.grad).abs().max())])
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    return {"out_err": errors[0].item(), "dsink_err": errors[1].item(), "dsink_norm": float(full_sinks.grad.norm()),
            "local_dsink_nonzero": int((local_sinks.grad != 0).sum())}


def main() -> None:
    dist.init_process_group("gloo")
    set_ulysses_sequence_parallel_group(dist.group.WORLD)
    results = {hkv: check(int(hkv)) for hkv in sys.argv[2:]}
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
