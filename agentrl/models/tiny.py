"""Tiny random-init GPT-OSS models for tests and benchmarks (no download needed).

The architecture is transformers' ``GptOssForCausalLM``: attention sinks, alternating sliding/full
attention, a top-k MoE router (``GptOssTopKRouter``) and the 201,088-token o200k_harmony vocabulary by
default, so token ids from the Harmony format are valid. Eager attention is selected because it honours
the sinks (transformers refuses ``sdpa`` for GPT-OSS).
"""

from __future__ import annotations

import torch


def tiny_gpt_oss(
    num_layers: int = 2,
    hidden: int = 64,
    experts: int = 4,
    top_k: int = 2,
    vocab: int = 201088,
    *,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    max_position_embeddings: int = 4096,
    sliding_window: int = 128,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    attn_implementation: str = "eager",
    device: str | torch.device = "cpu",
):
    """A randomly initialised ``GptOssForCausalLM``; the same ``seed`` gives the same weights.

    ``hidden`` must be divisible by ``heads``; ``heads`` by ``kv_heads``. Layers alternate
    sliding-window and full attention like the released models. YaRN rope scaling keeps
    ``original_max_position_embeddings * factor == max_position_embeddings`` (factor 32 when possible).
    """
    from transformers import GptOssConfig, GptOssForCausalLM

    if hidden % heads or heads % kv_heads:
        raise ValueError(
            f"hidden ({hidden}) must divide by heads ({heads}) and heads by kv_heads ({kv_heads})"
        )
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k ({top_k}) must be between 1 and experts ({experts})")
    factor = 32.0 if max_position_embeddings % 32 == 0 else 1.0
    config = GptOssConfig(
        num_hidden_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=intermediate or hidden,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        vocab_size=vocab,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_position_embeddings,
        sliding_window=sliding_window,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
        rope_parameters={
            "rope_type": "yarn",
            "factor": factor,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": int(max_position_embeddings / factor),
            "rope_theta": 150000.0,
        },
        # o200k_harmony's <|endoftext|>, <|return|> and <|startoftext|>; dropped for toy vocabularies
        pad_token_id=199999 if vocab > 200002 else None,
        eos_token_id=200002 if vocab > 200002 else None,
        bos_token_id=199998 if vocab > 200002 else None,
    )
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GptOssForCausalLM(config)
    return model.to(device=device, dtype=dtype).eval()
