"""The one tiny-Llama factory of the tests: a random-init fp32 ``LlamaForCausalLM`` of a given shape."""

from __future__ import annotations

from typing import Any


def tiny_llama(seed: int | None = 0, *, vocab: int = 100, hidden: int = 16, intermediate: int = 32, layers: int = 1,
               heads: int = 2, kv_heads: int = 1, positions: int | None = None, **config: Any):
    """A Llama of this shape (default: 1 layer, 100-token vocabulary), in train mode as transformers builds it.

    ``seed``: ``torch.manual_seed(seed)`` right before the weights are drawn (None: the caller's RNG state).
    ``positions``: ``max_position_embeddings`` (None: transformers' default). ``config``: more ``LlamaConfig``
    fields, as they are (``tie_word_embeddings=True``, ``attention_dropout=0.5``, ``attn_implementation=...``).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if positions is not None:
        config["max_position_embeddings"] = positions
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, **config)
    if seed is not None:
        torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)
