"""One torchrun rank of the Ulysses sink-attention checks (CPU/gloo): verl's all-to-all + our sink slicing.

1. Attention alone (``HKV`` KV heads each): each rank holds a contiguous sequence chunk of q, k, v (all
   heads) and position ids, and the full sink vector; ``ulysses_attention`` must return that chunk of the
   full-sequence output, and the sink gradients summed over ranks must equal the full-sequence ones.
2. A tiny GPT-OSS with ``attn_implementation="agentrl_sink"`` (the registered Ulysses-aware kernel; run
   with ``TRITON_INTERPRET=1``), two packed sequences sliced by verl's ``ulysses_pad_and_slice_inputs``:
   logits and sink gradients must equal those of the same model without sequence parallelism.

Rank 0 writes the errors as JSON.

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


def check_model() -> dict:
    from verl.utils.ulysses import gather_outputs_and_unpad, ulysses_pad_and_slice_inputs

    from agentrl.models.tiny import tiny_gpt_oss
    from agentrl.train.verl_backend.ulysses import register_ulysses_sink_attention

    register_ulysses_sink_attention()
    model = tiny_gpt_oss(num_layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, seed=0,
                         attn_implementation="agentrl_sink")
    sinks = [layer.self_attn.sinks for layer in model.model.layers]
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (1, 13))
    pos = torch.cat([torch.arange(8), torch.arange(5)])[None]  # two packed sequences; 13 pads to 14
    weights = torch.randn(1, 13, 256)

    set_ulysses_sequence_parallel_group(None)
    ref = model(input_ids=ids, position_ids=pos).logits
    ref_grads = torch.autograd.grad((ref * weights).sum(), sinks)

    set_ulysses_sequence_parallel_group(dist.group.WORLD)
    ids_l, pos_l, pad = ulysses_pad_and_slice_inputs(ids, pos, sp_size=dist.get_world_size())
    local = model(input_ids=ids_l, position_ids=pos_l).logits
    full = gather_outputs_and_unpad(local, gather_dim=1, unpad_dim=1, padding_size=pad, grad_scaler=False)
    grads = torch.autograd.grad((full * weights).sum(), sinks)
    for g in grads:  # each rank holds d(sink) of its own heads; the data-parallel reduction sums them
        dist.all_reduce(g)
    errors = torch.tensor([float((full - ref).detach().abs().max()),
                           max(float((g - r).abs().max()) for g, r in zip(grads, ref_grads, strict=True))])
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    return {"logits_err": errors[0].item(), "dsink_err": errors[1].item(),
            "dsink_norm": float(torch.stack([g.norm() for g in ref_grads]).norm())}


def main() -> None:
    dist.init_process_group("gloo")
    set_ulysses_sequence_parallel_group(dist.group.WORLD)
    results = {hkv: check(int(hkv)) for hkv in sys.argv[2:]}
    results["model"] = check_model()
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
