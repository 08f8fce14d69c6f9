"""FlashAttention-4 (CuTe DSL, PyPI ``flash-attn-4``) as a backend of :func:`sink_attention`.

FA4 has learnable sinks in its forward and backward (d sink) on SM90 and SM100/SM110. This module
only translates between our conventions and FA4's; the math is the same (see sink_attention.py):

* Layout: FA4 takes dense tensors as ``[B, N, H, D]``; ours are ``[B, H, N, D]``. The transpose is a
  view (no copy): FA4 accepts any layout whose last dimension is contiguous and whose other strides
  are 16-byte aligned, and copies otherwise. Its output ``[B, N, H, D]`` is handed back as the
  transposed view ``[B, H, N, D]``, which is what transformers wants after its own transpose.
  Packed tensors (``[total, H, D]``) and the LSE (``[B, H, N]`` / ``[H, total]``) have the same
  layout in both.
* Window: ours counts ``window`` keys including the query itself, FA4's ``window_size=(window-1, 0)``.
* Causal with ``Nq < Nk``: both align the queries to the last positions (bottom-right).
* Sinks: FA4 takes fp16/bf16/fp32 sinks and returns d sink in their dtype; we hand it fp32 sinks
  (a cast in the autograd graph when the parameter is stored in another dtype).

``flash_attn.cute`` is imported on first use only; :func:`unsupported_reason` says why a call
cannot run on FA4 (``None`` when it can).
"""

from __future__ import annotations

import functools

import torch

_FA4_DTYPES = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=1)
def _import_error() -> str | None:
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as exc:  # ImportError, or a broken CUDA/cutlass install underneath
        return f"{type(exc).__name__}: {exc}"
    return None


def available() -> bool:
    """True when ``flash_attn.cute`` (flash-attn-4) imports."""
    return _import_error() is None


@functools.lru_cache(maxsize=16)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def unsupported_reason(q: torch.Tensor, head_dim: int, sinks: torch.Tensor | None, causal: bool,
                       window: int | None) -> str | None:
    """Why FA4 cannot compute this call (``None`` if it can). Checks that need no import first."""
    if not q.is_cuda:
        return f"FA4 runs on CUDA tensors only (got {q.device})"
    major = _capability(q.device.index if q.device.index is not None else torch.cuda.current_device())[0]
    if major not in (9, 10, 11):
        return (f"FA4's backward with learnable sinks needs SM90 or SM100/SM110 (Hopper or Blackwell); "
                f"this GPU is SM{major}x")
    if q.dtype not in _FA4_DTYPES:
        return f"FA4 takes fp16/bf16 inputs; got {q.dtype} (use backend='triton' for fp32)"
    if head_dim % 8 or head_dim > 256:
        return f"FA4 takes head_dim a multiple of 8 up to 256; got {head_dim}"
    if window is not None and not causal:
        return "a sliding window needs causal=True"
    err = _import_error()
    if err is not None:
        return f"flash-attn-4 is not importable ({err}); install it with pip install 'agentrl-sdk[fa4]'"
    return None


def fa4_sink_attention(q, k, v, sinks, *, causal: bool, window: int | None, scale: float,
                       cu_q: torch.Tensor | None, cu_k: torch.Tensor | None, max_q: int | None,
                       max_k: int | None, want_lse: bool):
    """Run FA4 on inputs already validated by :func:`sink_attention` (our layouts in and out).

    Dense: ``q`` ``[B, Hq, Nq, D]``, ``k``/``v`` ``[B, Hkv, Nk, D]``; packed: ``[total, H, D]`` with
    int32 ``cu_q``/``cu_k``. Returns ``(out, lse)`` (``lse`` ``None`` unless ``want_lse``), ``out``
    shaped like ``q``, differentiable in q, k, v and sinks through FA4's autograd function.
    """
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    window_size = (window - 1, 0) if window is not None else (None, None)
    sink32 = sinks.float() if sinks is not None else None
    if cu_q is not None:
        out, lse = flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
            softmax_scale=scale, causal=causal, window_size=window_size, learnable_sink=sink32,
            return_lse=want_lse)
        return out, (lse if want_lse else None)
    out, lse = flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale, causal=causal,
        window_size=window_size, learnable_sink=sink32, return_lse=want_lse)
    return out.transpose(1, 2), (lse if want_lse else None)
