"""Token log-probs and entropies without materialising ``[N, V]`` logits.

With a 201,088-token vocabulary the logits of 8 x 2048 tokens are 13 GB in fp32, and autograd keeps
several such tensors for the backward. :func:`chunked_logprobs` instead computes the LM head, the
log-softmax and the entropy ``chunk_size`` tokens at a time, keeps only ``[N]`` log-sum-exp statistics,
and recomputes each chunk's logits in a custom backward. Peak extra memory is two ``chunk_size x V``
fp32 buffers plus the weight gradient (``V x H``), independent of ``N``.
"""

from __future__ import annotations

from typing import Any

import torch

IGNORE_INDEX = -100


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[C, V]`` fp32 logits of one chunk: matmul in the input dtype (as the model's lm_head), upcast after."""
    logits = (hidden @ weight.t()).float()
    return logits / temperature if temperature != 1.0 else logits


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, temperature, compute_entropy):
        n = hidden.shape[0]
        logprobs = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        lse = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros(n, dtype=torch.float32, device=hidden.device) if compute_entropy else None
        valid = labels != IGNORE_INDEX
        safe_labels = torch.where(valid, labels, torch.zeros_like(labels))
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            logits = _chunk_logits(hidden[s:e], weight, temperature)
            chunk_lse = torch.logsumexp(logits, dim=-1)
            lse[s:e] = chunk_lse
            picked = logits.gather(1, safe_labels[s:e, None]).squeeze(1)
            logprobs[s:e] = torch.where(valid[s:e], picked - chunk_lse, torch.zeros_like(picked))
            if compute_entropy:  # H = -sum p log p, with log p in the logits' buffer and p * log p in p's
                logp = logits.sub_(chunk_lse[:, None])
                entropy[s:e] = -logp.exp().mul_(logp).sum(dim=-1)
            del logits
        ctx.save_for_backward(hidden, weight, safe_labels, valid, lse, entropy if compute_entropy else lse)
        ctx.chunk_size, ctx.temperature, ctx.compute_entropy = chunk_size, temperature, compute_entropy
        ctx.mark_non_differentiable(lse)
        return logprobs, (entropy if compute_entropy else lse.new_empty(0))

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, labels, valid, lse, entropy = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        use_entropy = ctx.compute_entropy and grad_entropy is not None and grad_entropy.numel() > 0
        grad_hidden = torch.zeros_like(hidden) if need_h else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(lse)
        g = torch.where(valid, grad_logprobs, torch.zeros_like(grad_logprobs))
        n = hidden.shape[0]
        for s in range(0, n, ctx.chunk_size):
            e = min(s + ctx.chunk_size, n)
            # two [C, V] buffers at a time: log p (in the logits' buffer), then p, which becomes the gradient.
            # d logprob / d logits = onehot(label) - p;  d H / d logits_k = -p_k (log p_k + H), so
            # d(g * logprob + g_H * H) / d logits_k = onehot * g - p_k (g + g_H (log p_k + H)).
            logp = _chunk_logits(hidden[s:e], weight, ctx.temperature).sub_(lse[s:e, None])
            grad = logp.exp()
            if use_entropy:
                grad.mul_(logp.add_(entropy[s:e, None]).mul_(grad_entropy[s:e, None]).add_(g[s:e, None])).neg_()
            else:
                grad.mul_(-g[s:e, None])
            del logp
            grad.scatter_add_(1, labels[s:e, None], g[s:e, None])
            if ctx.temperature != 1.0:
                grad /= ctx.temperature
            if need_h:
                grad_hidden[s:e] = (grad.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                grad_weight += grad.t() @ hidden[s:e].float()
            del grad
        if need_w:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def chunked_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    compute_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``labels`` under ``softmax(hidden @ W.T / temperature)``, computed in token chunks.

    Args:
      hidden: ``[N, H]`` final hidden states (after the final norm), any float dtype.
      lm_head_weight: ``[V, H]`` (same dtype as ``hidden``); no bias.
      labels: ``[N]`` int64 token ids; ``-100`` marks positions to skip (log-prob 0, no gradient).
      chunk_size: tokens per chunk; peak extra memory is about ``2 * chunk_size * V * 4`` bytes.
    Returns ``(logprobs [N] fp32, entropy [N] fp32 or None)``; entropy is computed at every position,
    ``-100`` ones included (mask it yourself). Differentiable w.r.t. ``hidden`` and
    ``lm_head_weight`` (the backward recomputes each chunk's logits; nothing of size ``[N, V]`` is kept).
    """
    if hidden.dim() != 2 or lm_head_weight.dim() != 2 or hidden.shape[1] != lm_head_weight.shape[1]:
        raise ValueError(
            f"need hidden [N, H] and lm_head_weight [V, H], got {tuple(hidden.shape)} and "
            f"{tuple(lm_head_weight.shape)}"
        )
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must be [N]={tuple(hidden.shape[:1])}, got {tuple(labels.shape)}")
    if chunk_size < 1 or temperature <= 0:
        raise ValueError(f"chunk_size must be >= 1 and temperature > 0, got {chunk_size} and {temperature}")
    if hidden.dtype != lm_head_weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and lm_head_weight ({lm_head_weight.dtype}) dtypes differ")
    logprobs, entropy = _ChunkedLogProbs.apply(
        hidden, lm_head_weight, labels.long(), int(chunk_size), float(temperature), bool(compute_entropy)
    )
    return logprobs, (entropy if compute_entropy else None)


def model_token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
    """:func:`backbone_token_logprobs`, run through the FSDP2 root's forward hooks when the model is
    sharded by :func:`agentrl.train.distributed.shard` (which sets ``model.fsdp_token_logprobs``)."""
    fsdp_forward = getattr(model, "fsdp_token_logprobs", None)
    if fsdp_forward is not None:
        return fsdp_forward(input_ids, attention_mask, **kwargs)
    return backbone_token_logprobs(model, input_ids, attention_mask, **kwargs)


def backbone_token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    response_start: int = 1,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    **model_kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of each token ``input_ids[:, t]`` given ``input_ids[:, :t]``, for ``t >= response_start``.

    Runs the backbone ``model.model(...)`` (LlamaForCausalLM, GptOssForCausalLM and other HF causal LMs
    with ``.model`` and ``.lm_head``) and :func:`chunked_logprobs` with ``model.lm_head.weight``, so
    ``[B, S, V]`` logits are never built. Positions where ``attention_mask`` is 0 get log-prob 0.

    Args:
      input_ids: ``[B, S]``; attention_mask: ``[B, S]`` (1 = real token) or None.
      response_start: first position scored (``>= 1``: position 0 has no context); the result covers
        positions ``response_start .. S-1``.
      model_kwargs: passed to the backbone (e.g. ``position_ids``).
    Returns ``(logprobs [B, S - response_start] fp32, entropy of the same shape or None)``.
    """
    if getattr(model, "lm_head", None) is None or getattr(model, "model", None) is None:
        raise TypeError(
            f"{type(model).__name__} has no .model backbone and .lm_head; pass a *ForCausalLM model"
        )
    if model.lm_head.bias is not None:
        raise ValueError("lm_head has a bias; chunked_logprobs supports bias-free LM heads only")
    start = int(response_start)
    if not 1 <= start < input_ids.shape[1]:
        raise ValueError(f"response_start must be in [1, S-1] = [1, {input_ids.shape[1] - 1}], got {start}")
    bsz, seqlen = input_ids.shape
    out = model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **model_kwargs)
    hidden = out.last_hidden_state[:, start - 1 : seqlen - 1]  # predicts tokens start..S-1
    labels = input_ids[:, start:].clone()
    if attention_mask is not None:
        labels = labels.masked_fill(attention_mask[:, start:] == 0, IGNORE_INDEX)
    return lm_head_logprobs(model, hidden, labels, chunk_size=chunk_size, temperature=temperature,
                            compute_entropy=compute_entropy)


def lm_head_logprobs(
    model: Any, hidden: torch.Tensor, labels: torch.Tensor, *, chunk_size: int, temperature: float,
    compute_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`chunked_logprobs` of ``labels`` ``[B, T]`` (``IGNORE_INDEX``: log-prob 0) given the backbone's
    ``hidden`` states ``[B, T, H]`` that predict them, through ``model.lm_head``; ``([B, T], [B, T] or None)``."""
    weight = model.lm_head.weight
    lp, ent = chunked_logprobs(
        hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype), weight, labels.reshape(-1),
        chunk_size=chunk_size, temperature=temperature, compute_entropy=compute_entropy,
    )
    shape = labels.shape
    return lp.view(shape), (None if ent is None else ent.view(shape))
