"""Reference implementations of sink attention in plain torch (any device, differentiable).

* :func:`sink_attention_reference` computes in float64 from the definition; tests compare the Triton
  kernels against it.
* :func:`sink_attention_eager` mirrors transformers' GPT-OSS ``eager_attention_forward`` op for op
  (additive mask, sink column, max subtraction, softmax, sink dropped) in the input dtype.

Both materialise ``N x N`` scores: use them on small shapes only.
"""

from __future__ import annotations

import math

import torch


def _visible(n_q: int, n_k: int, causal: bool, window: int | None, device) -> torch.Tensor:
    """[n_q, n_k] bool: query row i (at key position i + n_k - n_q) may see key j."""
    pos = torch.arange(n_q, device=device)[:, None] + (n_k - n_q)
    cols = torch.arange(n_k, device=device)[None, :]
    ok = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    if causal:
        ok &= cols <= pos
    if window is not None:
        ok &= cols > pos - window
    return ok


def _dense_reference(q, k, v, sinks, causal, window, scale):
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    ok = _visible(q.shape[2], k.shape[2], causal, window, q.device)
    scores = scores.masked_fill(~ok, float("-inf"))
    if sinks is None:
        sink_col = torch.full_like(scores[..., :1], float("-inf"))
    else:
        sink_col = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
    lse = torch.logsumexp(torch.cat([scores, sink_col], dim=-1), dim=-1)
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - lse_safe[..., None])
    return torch.matmul(probs, v), lse


def sink_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None,
    *,
    causal: bool = True,
    window: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    return_lse: bool = False,
    softmax_scale: float | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
):
    """Float64 sink attention from the definition, with the same signature and layouts as
    :func:`agentrl.kernels.sink_attention` (``max_seqlen*`` are accepted and unused).

    Inputs of any float dtype are upcast to float64 (autograd flows back to them); the outputs are
    float64: ``out`` ``[B, Hq, Nq, D]`` / ``[total_q, Hq, D]`` and, with ``return_lse``, ``L``
    ``[B, Hq, Nq]`` / ``[Hq, total_q]``.
    """
    del max_seqlen, max_seqlen_k
    head_dim = q.shape[-1]
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    q64, k64, v64 = q.double(), k.double(), v.double()
    s64 = sinks.double() if sinks is not None else None
    if cu_seqlens is None:
        out, lse = _dense_reference(q64, k64, v64, s64, causal, window, scale)
        return (out, lse) if return_lse else out
    cu_q = [int(x) for x in cu_seqlens.tolist()]
    cu_k = cu_q if cu_seqlens_k is None else [int(x) for x in cu_seqlens_k.tolist()]
    outs, lses = [], []
    for i in range(len(cu_q) - 1):
        qs = q64[cu_q[i]:cu_q[i + 1]].transpose(0, 1)[None]
        ks = k64[cu_k[i]:cu_k[i + 1]].transpose(0, 1)[None]
        vs = v64[cu_k[i]:cu_k[i + 1]].transpose(0, 1)[None]
        o, lse = _dense_reference(qs, ks, vs, s64, causal, window, scale)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    out = torch.cat(outs, dim=0)
    lse = torch.cat(lses, dim=1)
    return (out, lse) if return_lse else out


def sink_attention_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    *,
    causal: bool = True,
    window: int | None = None,
    softmax_scale: float | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Transformers' GPT-OSS eager attention, op for op, on dense tensors in their own dtype.

    ``q`` ``[B, Hq, Nq, D]``, ``k``/``v`` ``[B, Hkv, Nk, D]``, ``sinks`` ``[Hq]``. The mask is the
    causal/window pattern (bottom-right aligned) as an additive ``finfo.min`` mask, unless an additive
    ``attention_mask`` ``[B, 1, Nq, Nk]`` is given, which is used instead. Returns ``[B, Hq, Nq, D]``.
    """
    head_dim = q.shape[-1]
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    group = q.shape[1] // k.shape[1]
    b, hkv, n_k, d = k.shape
    key_states = k[:, :, None].expand(b, hkv, group, n_k, d).reshape(b, hkv * group, n_k, d)
    value_states = v[:, :, None].expand(b, hkv, group, n_k, d).reshape(b, hkv * group, n_k, d)
    attn_weights = torch.matmul(q, key_states.transpose(2, 3)) * scale
    if attention_mask is None and (causal or window is not None):
        ok = _visible(q.shape[2], n_k, causal, window, q.device)
        attention_mask = torch.zeros(ok.shape, dtype=q.dtype, device=q.device)
        attention_mask = attention_mask.masked_fill(~ok, torch.finfo(q.dtype).min)[None, None]
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    sink_col = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
    combined = torch.cat([attn_weights, sink_col.to(attn_weights.dtype)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)
    return torch.matmul(probs[..., :-1].to(value_states.dtype), value_states)
