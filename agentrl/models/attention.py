"""Grouped-query SDPA for CPU: transformers' ``sdpa`` without copying the keys and values per query head.

transformers' ``sdpa`` attention repeats a GQA model's key/value heads to the query heads (``repeat_kv``)
whenever an attention mask is passed, which is always the case for padded batches. On the CPU that copy is
most of a decode step: for SmolLM2-135M (9 query heads, 3 KV heads, 30 layers) at batch 64 and 330 cached
tokens, one layer's attention took 56 ms with the copy and 3.4 ms with PyTorch's own grouped-query path
(``scaled_dot_product_attention(..., enable_gqa=True)``), with identical results. :func:`use_gqa_sdpa`
registers that path as the attention implementation ``agentrl_sdpa_gqa`` (with ``sdpa``'s mask function) and
switches a loaded model to it. GPUs keep ``sdpa``: there a mask with ``enable_gqa`` falls back to the slow
math kernel.
"""

from __future__ import annotations

from typing import Any

import torch

NAME = "agentrl_sdpa_gqa"


def sdpa_gqa_attention_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: ``query`` ``[B, Hq, Q, D]``, ``key``/``value`` ``[B, Hkv, K, D]``
    (``Hq`` a multiple of ``Hkv``), ``attention_mask`` as ``sdpa`` gets it (bool or additive, or None).
    Returns ``([B, Q, Hq, D], None)`` like transformers' ``sdpa_attention_forward``."""
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = query.shape[2] > 1 and attention_mask is None and is_causal
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register :data:`NAME` with transformers (attention and mask interfaces); idempotent. Returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, sdpa_gqa_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def use_gqa_sdpa(model: Any) -> bool:
    """Switch ``model`` from ``sdpa`` to :data:`NAME` when it runs on the CPU with grouped-query attention
    (fewer key/value heads than query heads) and PyTorch has ``enable_gqa`` (>= 2.5). Returns whether it did."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if not heads or not kv_heads or kv_heads == heads:
        return False
    if next(model.parameters()).device.type != "cpu":
        return False
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 5):
        return False
    try:
        model.set_attn_implementation(register())
    except (ValueError, ImportError, AttributeError):  # a transformers version without these interfaces
        return False
    return True
