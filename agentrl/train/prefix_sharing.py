"""Training forward with the prompt prefix shared across rows (same maths, less compute).

Rollouts of one env start with the same system prompt (instructions, tool docs): hundreds of tokens that
a plain batched forward recomputes, and backpropagates through, once per row. Here the longest token
prefix common to all rows' prompts runs once (batch 1, with gradient), its KV cache is repeated to the
``b`` rows (``repeat_interleave``, whose backward sums the rows' gradients into the prefix), and each
row's suffix (rest of prompt + response) runs on top of it. Log-probs and entropies come from
:func:`agentrl.train.logprobs.chunked_logprobs` on the hidden states that predict response tokens, so
results equal ``model_token_logprobs`` on the full rows up to float rounding (tested).

Used for dense models without sliding-window attention (Llama/SmolLM2/Qwen-style) when the shared
prefix has at least ``min_prefix`` tokens; :func:`shared_prefix_logprobs` returns None otherwise (and
the caller falls back to the plain forward), including for gradient checkpointing, which disables the
KV cache.
"""

from __future__ import annotations

from typing import Any

import torch

from agentrl.train.batch import Batch
from agentrl.train.logprobs import IGNORE_INDEX, lm_head_logprobs


def supports_prefix_sharing(model: Any) -> bool:
    config = getattr(model, "config", None)
    sliding = getattr(config, "sliding_window", None) is not None or "sliding_attention" in (
        getattr(config, "layer_types", None) or ()
    )
    return (
        not sliding
        and not getattr(model, "is_gradient_checkpointing", False)
        and getattr(model, "lm_head", None) is not None
        and getattr(model.lm_head, "bias", None) is None
    )


def _common_prefix(rows: list[torch.Tensor], limit: int) -> int:
    first = rows[0][:limit]
    n = limit
    for row in rows[1:]:
        same = (row[:n] == first[:n]).long()
        n = int(same.cumprod(0).sum())
    return n


def shared_prefix_logprobs(
    model: Any, batch: Batch, *, chunk_size: int, temperature: float, compute_entropy: bool, min_prefix: int = 32
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(logprobs [B, R], entropy [B, R] or None)`` of ``batch.responses`` (0 on padding), or None when
    sharing does not apply (see the module docstring)."""
    b = len(batch)
    if b < 2 or not supports_prefix_sharing(model):
        return None
    width_p = batch.prompt_width
    real = batch.attention_mask.bool()
    prompt_lens = real[:, :width_p].sum(-1)
    rows = [batch.input_ids[i][real[i]] for i in range(b)]  # prompt + response, contiguous real tokens
    shared = _common_prefix(rows, int(prompt_lens.min()) - 1)  # every row keeps >= 1 prompt token
    if shared < min_prefix:
        return None
    device = batch.input_ids.device
    suffix_lens = [len(r) - shared for r in rows]
    width = max(suffix_lens)
    suffix = torch.zeros((b, width), dtype=torch.long, device=device)
    mask = torch.zeros((b, shared + width), dtype=torch.long, device=device)
    mask[:, :shared] = 1
    for i, r in enumerate(rows):
        suffix[i, : suffix_lens[i]] = r[shared:]
        mask[i, shared : shared + suffix_lens[i]] = 1
    positions = (torch.arange(width, device=device) + shared).expand(b, width)

    backbone = model.model
    prefix_out = backbone(input_ids=rows[0][None, :shared], use_cache=True)
    cache = prefix_out.past_key_values
    cache.batch_repeat_interleave(b)
    hidden = backbone(
        input_ids=suffix, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True
    ).last_hidden_state  # [b, width, H]

    resp_width = batch.responses.shape[1]
    # response token t of row i sits at suffix index (prompt_len_i - shared + t); its predictor is one before
    start = (prompt_lens - shared - 1).to(device)
    index = (start[:, None] + torch.arange(resp_width, device=device)[None, :]).clamp(max=width - 1)
    picked = hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1]))
    labels = batch.responses.masked_fill(~real[:, width_p:], IGNORE_INDEX)
    return lm_head_logprobs(model, picked, labels, chunk_size=chunk_size, temperature=temperature,
                            compute_entropy=compute_entropy)
