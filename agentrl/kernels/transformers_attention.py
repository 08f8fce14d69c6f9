"""Sink attention as a transformers attention implementation (GPT-OSS and other causal LMs).

After ``register_transformers_attention("agentrl_sink")``, ``GptOssForCausalLM.from_pretrained(...,
attn_implementation="agentrl_sink")`` (or ``config._attn_implementation = "agentrl_sink"``) runs its
attention through :func:`agentrl.kernels.sink_attention`, in training and in generation with a KV cache.

Masks: the registered mask function hands the attention a 2-D key padding mask (or ``None`` when
nothing is padded), as for FlashAttention-2. With padding, the valid tokens of each row are packed
into variable-length sequences, which assumes each row's valid tokens are contiguous (left or right
padding) and that the queries are the last ``q_len`` key positions (a dynamic KV cache). Packed
rows given by ``cu_seq_lens_q``/``cu_seq_lens_k`` kwargs, or by ``position_ids`` restarting at 0 in
a batch of one, are handled the same way.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from agentrl.kernels.sink_attention import sink_attention


def _padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                  attention_mask=None, **kwargs):
    """Mask function for ``AttentionMaskInterface``: ``None`` without padding, else the 2-D bool mask
    ``[B, kv_length]`` (True = real token), aligned with the keys of the layer."""
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    if bool(attention_mask.all()):
        return None
    return attention_mask.to(torch.bool)


def _cu_from_counts(counts: torch.Tensor) -> torch.Tensor:
    return F.pad(torch.cumsum(counts, 0, dtype=torch.int32), (1, 0))


def _packed_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """cu_seqlens of sequences packed in one row, from positions restarting at 0; None if not packed."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).flatten()  # one host sync
    if starts.numel() <= 1 or int(starts[0]) != 0:
        return None
    bounds = torch.cat([starts, starts.new_tensor([pos.numel()])])
    return bounds.to(torch.int32)


def agentrl_sink_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                   sliding_window=None, s_aux=None, *, backend=None, **kwargs):
    """transformers attention function: ``query`` ``[B, Hq, Nq, D]``, ``key``/``value``
    ``[B, Hkv, Nk, D]``; returns ``(attn_output [B, Nq, Hq, D], None)``. ``s_aux`` is the sink
    parameter (GPT-OSS passes ``module.sinks``); without it this is plain causal attention.
    ``backend``: as for :func:`agentrl.kernels.sink_attention` (None: ``auto`` or
    ``$AGENTRL_SINK_BACKEND``), chosen per layer call, so GPT-OSS's sliding and full layers can
    take different kernels."""
    if dropout and dropout > 0.0:
        raise ValueError(f"agentrl_sink attention has no dropout; got attention dropout {dropout}. "
                         "Set config.attention_dropout=0.0 (GPT-OSS's default).")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            "agentrl_sink attention takes causal/sliding masks plus a 2-D padding mask; it got a "
            f"{attention_mask.dim()}-D mask of shape {tuple(attention_mask.shape)}. Pass a 2-D "
            "attention_mask (or none) to the model, and register the implementation with "
            "agentrl.kernels.register_transformers_attention() so its mask function is used.")
    b, hq, n_q, d = query.shape
    n_k = key.shape[2]
    causal = getattr(module, "is_causal", True)
    window = int(sliding_window) if sliding_window else None
    cu_q = kwargs.get("cu_seq_lens_q")
    cu_k = kwargs.get("cu_seq_lens_k")
    position_ids = kwargs.get("position_ids")
    if cu_q is None and attention_mask is None and position_ids is not None and b == 1 and n_q == n_k > 1:
        cu_q = _packed_from_position_ids(position_ids)
        cu_k = cu_q
    if cu_q is not None:
        if b != 1:
            raise ValueError(f"packed sequences (cu_seq_lens_q) need batch size 1; got {b}")
        cu_q = cu_q.to(device=query.device, dtype=torch.int32)
        cu_k = cu_q if cu_k is None else cu_k.to(device=query.device, dtype=torch.int32)
        q = query[0].transpose(0, 1)
        k = key[0].transpose(0, 1)
        v = value[0].transpose(0, 1)
        out = sink_attention(q, k, v, s_aux, causal=causal, window=window, cu_seqlens=cu_q,
                             cu_seqlens_k=cu_k, max_seqlen=kwargs.get("max_length_q"),
                             max_seqlen_k=kwargs.get("max_length_k"), softmax_scale=scaling,
                             backend=backend)
        return out[None], None
    if attention_mask is None:
        out = sink_attention(query, key, value, s_aux, causal=causal, window=window, softmax_scale=scaling,
                             backend=backend)
        return out.transpose(1, 2), None

    # Padding: pack each row's valid tokens into a variable-length sequence.
    kmask = attention_mask.to(device=query.device, dtype=torch.bool)
    if kmask.shape[1] < n_k:  # e.g. a static cache longer than what was seen: the rest is empty
        kmask = F.pad(kmask, (0, n_k - kmask.shape[1]), value=False)
    kmask = kmask[:, -n_k:]
    qmask = kmask[:, -n_q:]
    k_idx = torch.nonzero(kmask.reshape(-1)).flatten()
    q_idx = torch.nonzero(qmask.reshape(-1)).flatten()
    k_counts = kmask.sum(1)
    q_counts = qmask.sum(1)
    q = query.transpose(1, 2).reshape(b * n_q, hq, d)[q_idx]
    k = key.transpose(1, 2).reshape(b * n_k, key.shape[1], d)[k_idx]
    v = value.transpose(1, 2).reshape(b * n_k, value.shape[1], d)[k_idx]
    out_p = sink_attention(q, k, v, s_aux, causal=causal, window=window, cu_seqlens=_cu_from_counts(q_counts),
                           cu_seqlens_k=_cu_from_counts(k_counts), max_seqlen=int(q_counts.max()),
                           max_seqlen_k=int(k_counts.max()), softmax_scale=scaling,
                           backend=backend)
    out = out_p.new_zeros(b * n_q, hq, d).index_copy(0, q_idx, out_p)
    return out.view(b, n_q, hq, d), None


def register_transformers_attention(name: str = "agentrl_sink", backend: str | None = None) -> str:
    """Register sink attention under ``name`` with transformers' ``AttentionInterface`` (and its
    padding-mask function with ``AttentionMaskInterface``); returns ``name``. Idempotent.

    ``backend``: ``"auto"``, ``"triton"`` or ``"fa4"`` for every call through this name (None: the
    default of :func:`agentrl.kernels.sink_attention`, ``auto`` unless ``$AGENTRL_SINK_BACKEND``
    says otherwise). Register several names to compare backends in one process."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as exc:
        raise RuntimeError("register_transformers_attention needs transformers>=5 "
                           f"(pip install 'agentrl-sdk[train]'): {exc}") from exc
    from agentrl.kernels._dispatch import BACKENDS

    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None; got {backend!r}")
    fn = agentrl_sink_attention_forward if backend is None else functools.partial(
        agentrl_sink_attention_forward, backend=backend)
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, _padding_mask)
    return name
