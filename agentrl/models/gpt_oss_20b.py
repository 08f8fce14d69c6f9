"""GPT-OSS-20B's exact architecture with random weights, built on the target device through the meta device.

There are no GPT-OSS weights on PyPI, so a full-size run (memory, throughput, the whole training stack at
20.9B parameters) uses the released shape with random bf16 weights: ``model=gpt-oss-20b-random``.

:func:`gpt_oss_20b_config` is openai/gpt-oss-20b's ``config.json`` as a ``GptOssConfig``: 24 layers alternating
128-token sliding-window and full attention, hidden 2880, 64 query and 8 key/value heads of dimension 64 with
biases and learned sinks, 32 experts of intermediate size 2880 with top-4 routing, vocabulary 201,088, YaRN
RoPE (theta 150,000, factor 32 over 4,096 positions, beta 32/1, not truncated) up to 131,072 positions, RMS-norm
epsilon 1e-5, untied embeddings, o200k_harmony's special ids. Keyword overrides scale it down for tests
(``num_hidden_layers``, ``hidden_size``, ...).

:func:`random_init_model` builds it with transformers' own loading path, ``from_pretrained`` with an empty
state dict: the model is instantiated on the meta device (no memory, no init), its parameters are
materialised directly on ``device`` in ``dtype``, and every parameter, all of them "missing" from the empty
checkpoint, is initialised there by the model's own ``_init_weights`` (normal(0, 0.02) weights, zero biases,
as transformers initialises missing keys of a real checkpoint). Nothing is written to disk and no full copy
ever sits on the CPU, so a 42 GB model appears on the GPU in seconds.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any

import torch

GPT_OSS_20B: dict[str, Any] = {
    "num_hidden_layers": 24,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "vocab_size": 201088,
    "sliding_window": 128,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.02,
    "attention_bias": True,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "router_aux_loss_coef": 0.9,
    "output_router_logits": False,
    "hidden_act": "silu",
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
        "rope_theta": 150000.0,
    },
    "pad_token_id": 199999,
    "eos_token_id": 200002,
}
"""openai/gpt-oss-20b's architecture (its config.json without the MXFP4 ``quantization_config``)."""

def gpt_oss_20b_config(**overrides: Any) -> Any:
    """A ``GptOssConfig`` of GPT-OSS-20B's shape with ``overrides`` applied (keys of ``GptOssConfig``).
    ``layer_types`` alternate sliding and full attention over however many layers there are, sliding first; a
    vocabulary smaller than o200k_harmony's drops its pad and EOS ids (unless overridden)."""
    from transformers import GptOssConfig

    values = {**GPT_OSS_20B, **overrides}
    if int(values["vocab_size"]) <= 200002:  # a toy vocabulary has no o200k_harmony special ids
        values.update({k: overrides.get(k) for k in ("pad_token_id", "eos_token_id")})
    layers = int(values["num_hidden_layers"])
    values.setdefault("layer_types", ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)])
    return GptOssConfig(**values)


def count_parameters(config: Any) -> int:
    """Parameters of ``GptOssForCausalLM(config)``, counted on the meta device (no memory)."""
    from transformers import GptOssForCausalLM

    with torch.device("meta"):
        model = GptOssForCausalLM(config)
    return sum(p.numel() for p in model.parameters())


@contextmanager
def _quiet_loading_report():
    """transformers reports every parameter "missing" from the (deliberately) empty checkpoint: hundreds of
    lines for 20B. Hide that report; errors still show."""
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def random_init_model(
    config: Any,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    attn_implementation: str | None = None,
) -> Any:
    """A ``GptOssForCausalLM(config)`` with random weights, built on ``device`` in ``dtype`` through
    ``from_pretrained``'s meta-device path (see the module docstring), in train mode.

    The same ``seed``, device type and dtype give the same weights. ``attn_implementation``: as for
    ``from_pretrained`` (default eager, which honours the sinks)."""
    from transformers import GptOssForCausalLM

    kwargs: dict[str, Any] = {"attn_implementation": attn_implementation or "eager"}
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), _quiet_loading_report():
        torch.manual_seed(seed)
        model = GptOssForCausalLM.from_pretrained(
            None, config=config, state_dict={}, dtype=dtype, device_map=device, **kwargs
        )
    return model.train()
