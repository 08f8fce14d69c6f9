"""The physical limit of a decode step: the bytes one step must read, over a copy bandwidth measured on the same
device (issue 31). A step of ``B`` rows cannot run faster than reading these bytes once, so
``tok/s_limit = B / (bytes_per_step / bandwidth)``.

What :func:`step_bytes` counts, from the model's own parameters (it works on the meta device):

- **dense weights**, read once: every parameter but the MoE experts and the input embedding (attention with
  its biases and sinks, routers, norms, the lm_head);
- **input embedding**: only the ``B`` rows gathered (a table tied to the lm_head is read whole, as dense);
- **experts**, per MoE layer the expected number of distinct experts that ``B`` rows touch with top-``k`` of
  ``E``: ``E * (1 - (1 - k/E) ** B)`` (independent uniform routing), each with its weights and biases. Our
  engine's CUDA-graph decode runs every expert on every row (``SlotMoE`` ``dense=True``), so it reads all ``E``
  whatever ``B``: ``engine_bytes`` counts that; the two differ only at small ``B`` (8 rows of GPT-OSS-20B touch
  21 of 32 experts on average, 64 rows 31.99);
- **KV cache**, what our decode kernel really reads (``agentrl.kernels`` Triton forward, the decode
  configuration with ``BLOCK_N = 64``): a row whose query sees ``n`` keys reads all ``n`` on a full-attention
  layer; on a sliding-window layer (GPT-OSS: window 128 on every other layer) the kernel starts at the window's
  first key rounded down to a 64-key block, so it reads ``n - 64 * floor(max(n - W, 0) / 64)`` keys: between
  ``W`` and ``W + 63``, not the whole context. K and V of each key-value head are read once per row (the query
  heads of a group share the tile). Averaged over the run's decode steps, from the actual prompt lengths;
- **LoRA adapter** (when present): attention factors whole, expert factors of the touched experts.

Not counted: activations, logits and sampling (at B=256, 201,088 float32 logits per row are about 0.2 GB
written and read, under 1 % of GPT-OSS-20B's step) and the dense expert path's extra arithmetic.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Any

KV_BLOCK = 64
"""Keys per tile of the Triton decode kernel (``agentrl.kernels.sink_attention._pick``, decode case)."""


def expected_experts(n_experts: int, top_k: int, rows: int) -> float:
    """Expected distinct experts of ``n_experts`` that ``rows`` tokens touch, each routed to ``top_k`` of them
    uniformly and independently: ``E * (1 - (1 - k/E) ** rows)``."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** rows)


def keys_read(n_keys: int, window: int | None, block: int = KV_BLOCK) -> int:
    """Keys the decode kernel reads for one query that sees ``n_keys`` keys (see the module docstring)."""
    if window is None or n_keys <= window:
        return n_keys
    return n_keys - block * ((n_keys - window) // block)


def layer_windows(model: Any) -> list[int | None]:
    """Each decoder layer's sliding window (None: full attention), from its attention module as the engine's
    decoder reads it."""
    layers = model.model.layers
    return [int(w) if (w := getattr(layer.self_attn, "sliding_window", None)) else None for layer in layers]


def kv_bytes_per_step(prompt_lens: list[int], new_tokens: int, windows: list[int | None], kv_heads: int,
                      head_dim: int, elem_bytes: int) -> float:
    """Mean KV bytes one decode step reads over the run: every row decodes ``new_tokens - 1`` steps (the first
    token comes from the prefill), feeding positions ``P, ..., P + new_tokens - 2`` of a ``P``-token prompt."""
    steps = max(new_tokens - 1, 1)
    per_key = 2 * kv_heads * head_dim * elem_bytes  # K and V
    total = 0
    for p, rows in Counter(prompt_lens).items():
        total += rows * sum(keys_read(p + s + 1, w) for s in range(steps) for w in windows)
    return total * per_key / steps


def weight_bytes(model: Any) -> dict[str, int]:
    """Parameter bytes by what a decode step does with them: ``dense`` (read whole), ``embed`` (the input
    embedding table: rows gathered), ``experts`` (MoE expert tensors and biases), ``lora_dense`` and
    ``lora_experts`` (adapter factors). Expert tensors are those under an ``.experts.`` module (PEFT's wrappers
    included). A table tied to the lm_head counts as ``dense`` (the lm_head reads it whole)."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is not None and head.weight is embed:
        embed = None
    out = {"dense": 0, "embed": 0, "experts": 0, "lora_dense": 0, "lora_experts": 0}
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        expert = ".experts." in name
        if "lora_" in name:
            out["lora_experts" if expert else "lora_dense"] += size
        elif p is embed:
            out["embed"] += size
        else:
            out["experts" if expert else "dense"] += size
    return out


def step_bytes(model: Any, batch: int, prompt_lens: list[int], new_tokens: int) -> dict[str, float]:
    """Bytes one decode step of ``batch`` rows reads (see the module docstring): the components, ``total``
    (the physical figure, expected experts touched) and ``engine_total`` (every expert read, as our dense
    CUDA-graph MoE does)."""
    cfg = model.config
    w = weight_bytes(model)
    n_exp = int(getattr(cfg, "num_local_experts", 0) or 0)
    touched = expected_experts(n_exp, int(cfg.num_experts_per_tok), batch) / n_exp if n_exp else 1.0
    emb = model.get_input_embeddings().weight
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = kv_bytes_per_step(prompt_lens, new_tokens, layer_windows(model), int(cfg.num_key_value_heads),
                           int(head_dim), emb.element_size())
    parts = {
        "dense": float(w["dense"]),
        "embed_rows": float(batch * emb.shape[1] * emb.element_size()) if w["embed"] else 0.0,
        "experts": w["experts"] * touched,
        "kv": kv,
        "lora": w["lora_dense"] + w["lora_experts"] * touched,
        "experts_touched": touched * n_exp,
    }
    parts["total"] = parts["dense"] + parts["embed_rows"] + parts["experts"] + parts["kv"] + parts["lora"]
    parts["engine_total"] = (parts["total"] + w["experts"] * (1 - touched)
                             + w["lora_experts"] * (1 - touched))
    return parts


def tok_s_limit(batch: int, nbytes: float, bandwidth: float) -> float:
    """``batch / (nbytes / bandwidth)``: tokens per second if a step took only the time to read ``nbytes``."""
    return batch * bandwidth / nbytes


def planned_cache_bytes(model: Any, batch: int, max_prompt: int, new_tokens: int, *, min_length: int = 1024,
                        length_round: int = 64) -> int:
    """Bytes of the slot KV cache the decode engine allocates on a GPU for ``batch`` prompts submitted at once
    (``DecodeEngine(max_batch_size=batch)``): the scheduler's first reservation has the next power of two of
    ``batch`` slots (at most ``2 * batch``) of ``round_up(max(max_prompt + new_tokens + 1, min_length), 64)``
    positions, ``[layers, 2, slots, length, kv_heads, head_dim]`` in the model's dtype."""
    cfg = model.config
    slots = min(2 * batch, 1 << (batch - 1).bit_length())
    need = max(max_prompt + new_tokens + 1, min_length)
    length = -(-need // length_round) * length_round
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = model.get_input_embeddings().weight.element_size()
    return int(cfg.num_hidden_layers) * 2 * slots * length * int(cfg.num_key_value_heads) * int(head_dim) * elem


def copy_bandwidth(device: str, nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Bytes per second of a large device-to-device copy on ``device`` (read plus written, over the time of
    ``reps`` copies of an ``nbytes`` tensor after two untimed ones)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if src.is_cuda else (lambda: None)
    for _ in range(2):
        dst.copy_(src)
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync()
    elapsed = time.perf_counter() - t0
    del src, dst
    return 2 * nbytes * reps / elapsed if elapsed > 0 else math.nan
