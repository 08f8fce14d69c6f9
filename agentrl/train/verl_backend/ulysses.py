"""Sink attention under verl's Ulysses sequence parallelism (DeepSpeed-Ulysses).

Under Ulysses each rank holds ``S/P`` tokens of every head; an all-to-all before attention gives each
rank all ``S`` tokens of ``H/P`` heads, and one after attention restores the sequence split. verl patches
this only into FlashAttention's path, so with ``attn_implementation=agentrl_sink`` the attention
function itself must do it. The sink logits are per query head, so each rank must use the slice of
``sinks`` that belongs to its heads: :func:`local_heads` (heads ``[r*H/P, (r+1)*H/P)``, the order
verl's ``gather_seq_scatter_heads`` produces). Slicing through autograd sends each rank's d(sink) to
its own slice; the data-parallel gradient reduction (FSDP reduce-scatter over all ranks, SP ranks
included) then sums the slices, exactly as it sums the sequence chunks' gradients of every other weight.

Ring / context parallelism (not wired here) splits the keys instead: every rank then holds a partial
d(sink) for all heads over its query chunk, and those partials must be all-reduced (summed) across the
context-parallel group before the optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from agentrl.train.verl_backend.config_map import SINK_ATTENTION

AttentionFn = Callable[..., tuple[torch.Tensor, Any]]


def local_heads(tensor: torch.Tensor, sp_rank: int, sp_size: int, dim: int = 0) -> torch.Tensor:
    """The ``sp_rank``-th of ``sp_size`` equal head slices of ``tensor`` along ``dim`` (a differentiable view).

    Raises ValueError when the head count is not divisible by ``sp_size`` (verl requires it too).
    """
    heads = tensor.shape[dim]
    if sp_size < 1 or not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank={sp_rank} must be in [0, sp_size={sp_size})")
    if heads % sp_size:
        raise ValueError(
            f"{heads} heads cannot be split over a Ulysses group of {sp_size}; "
            "choose verl.ulysses_sp dividing the number of attention heads"
        )
    per = heads // sp_size
    return tensor.narrow(dim, sp_rank * per, per)


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[B, Hkv, S, D] -> [B, Hkv*n_rep, S, D]``, each KV head repeated ``n_rep`` times in place."""
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def ulysses_attention(inner: AttentionFn) -> AttentionFn:
    """Wrap a transformers attention function (``query [B, H, S, D]``, returns ``[B, S, H, D]``) so that
    under a verl Ulysses group of size ``P > 1`` it sees all tokens of its ``H/P`` heads and the matching
    sink slice. Without a group (or ``P == 1``, or no ``position_ids``: not a text forward) it calls
    ``inner`` unchanged."""
    from verl.utils.ulysses import (
        gather_heads_scatter_seq,
        gather_seq_scatter_heads,
        get_ulysses_sequence_parallel_group,
        get_ulysses_sequence_parallel_rank,
        get_ulysses_sequence_parallel_world_size,
    )

    def attention(module, query, key, value, attention_mask, *args, s_aux=None, position_ids=None, **kwargs):
        sp = get_ulysses_sequence_parallel_world_size()
        if sp <= 1 or position_ids is None:
            return inner(module, query, key, value, attention_mask, *args, s_aux=s_aux,
                         position_ids=position_ids, **kwargs)
        if attention_mask is not None:
            raise ValueError(
                "agentrl_sink under Ulysses needs packed inputs without a padding mask; "
                "set actor_rollout_ref.model.use_remove_padding=true"
            )
        group = get_ulysses_sequence_parallel_group()
        rank = get_ulysses_sequence_parallel_rank()
        repeats = max(sp // key.shape[1], 1)  # fewer KV heads than ranks: repeat them first
        key, value = _repeat_kv(key, repeats), _repeat_kv(value, repeats)
        # [B, H, S/P, D] -> [B, H/P, S, D]
        query = gather_seq_scatter_heads(query, seq_dim=2, head_dim=1, group=group)
        key = gather_seq_scatter_heads(key, seq_dim=2, head_dim=1, group=group)
        value = gather_seq_scatter_heads(value, seq_dim=2, head_dim=1, group=group)
        pieces = [torch.empty_like(position_ids) for _ in range(sp)]
        torch.distributed.all_gather(pieces, position_ids, group=group)
        position_ids = torch.cat(pieces, dim=-1)
        sinks = local_heads(s_aux, rank, sp) if s_aux is not None else None
        out, weights = inner(module, query, key, value, None, *args, s_aux=sinks,
                             position_ids=position_ids, **kwargs)
        # [B, S, H/P, D] -> [B, S/P, H, D]
        return gather_heads_scatter_seq(out, seq_dim=1, head_dim=2, group=group), weights

    return attention


def register_ulysses_sink_attention(name: str = SINK_ATTENTION) -> str:
    """Register Ulysses-aware sink attention as transformers attention ``name`` (plus the kernel's
    padding-mask function); idempotent. Returns ``name``."""
    from transformers import AttentionInterface

    from agentrl.kernels import register_transformers_attention
    from agentrl.kernels.transformers_attention import agentrl_sink_attention_forward

    register_transformers_attention(name)
    AttentionInterface.register(name, ulysses_attention(agentrl_sink_attention_forward))
    return name
