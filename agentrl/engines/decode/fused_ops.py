"""Triton kernels that fuse the small element-wise steps of a decoder layer (GPU decode path).

A decode step of a small model is bound by the number of kernels it launches, not by arithmetic: a
transformers Llama layer runs about 40 of them (RMSNorm alone is six). These three kernels cut a layer to
about ten:

* :func:`rms_norm`: optional residual add, then RMSNorm, in one pass per row. ``cast_first`` picks the
  rounding of the model family: Llama/Qwen multiply the weight with the normalised row *after* casting it
  to the activation dtype (``weight * x.to(dtype)``), GPT-OSS before (``(weight * x).to(dtype)``).
  The residual sum is rounded to the activation dtype before it is normalised, as transformers does.
* :func:`rope_store`: rotary embedding of q and k (the "halves" convention shared by Llama's
  ``rotate_half`` and GPT-OSS's ``_apply_rotary_emb``) and the store of k and v into the slot cache at
  ``(slot, position)``, for every token, in one kernel.
* :func:`silu_mul`: ``silu(gate) * up`` over a fused ``[gate | up]`` projection, with transformers'
  two roundings (after the activation, after the product).

Arithmetic is float32 inside the kernels; results round once to the activation dtype where transformers
rounds several times, so bf16 outputs can differ from transformers' in the last bit (float32 ones agree to
float32 rounding). All three run under ``TRITON_INTERPRET=1`` on CPU tensors (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(X, RES, W, Y, XOUT, stride_x, stride_r, stride_y, stride_xo, n_cols, eps,
                     HAS_RES: tl.constexpr, CAST_FIRST: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(RES + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(XOUT.dtype.element_ty)
        tl.store(XOUT + row * stride_xo + cols, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    y = x * (1.0 / tl.sqrt(var + eps))
    if CAST_FIRST:
        y = y.to(Y.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (w * y).to(Y.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: torch.Tensor | None = None,
             cast_first: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual), x + residual)`` for ``x`` ``[N, H]`` (``residual`` ``[N, H]`` or None: then
    the second output is ``x`` itself). See the module docstring for ``cast_first``."""
    n, h = x.shape
    y = torch.empty_like(x)
    xo = torch.empty_like(x) if residual is not None else x
    block = triton.next_power_of_2(h)
    _rms_norm_kernel[(n,)](
        x, residual if residual is not None else x, weight, y, xo, x.stride(0),
        residual.stride(0) if residual is not None else 0, y.stride(0), xo.stride(0), h, float(eps),
        HAS_RES=residual is not None, CAST_FIRST=cast_first, BLOCK=block, num_warps=4 if block >= 1024 else 2,
    )
    return y, xo


@triton.jit
def _rope_store_kernel(Q, K, V, COS, SIN, POS, WPOS, SLOT, QO, KC, VC,
                       sq, sk, sv, s_cos, sqo, kc_s, kc_l, kc_h, vc_s, vc_l, vc_h,
                       HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
                       BLOCK_HKV: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + t).to(tl.int64)
    wpos = tl.load(WPOS + t).to(tl.int64)
    slot = tl.load(SLOT + t).to(tl.int64)
    i = tl.arange(0, HALF)
    c = tl.load(COS + pos * s_cos + i).to(tl.float32)[None, :]
    s = tl.load(SIN + pos * s_cos + i).to(tl.float32)[None, :]
    hq = tl.arange(0, BLOCK_HQ)[:, None]
    mq = hq < HQ
    q1 = tl.load(Q + t * sq + hq * (2 * HALF) + i[None, :], mask=mq, other=0.0).to(tl.float32)
    q2 = tl.load(Q + t * sq + hq * (2 * HALF) + HALF + i[None, :], mask=mq, other=0.0).to(tl.float32)
    qo = QO + t * sqo + hq * (2 * HALF) + i[None, :]
    tl.store(qo, (q1 * c - q2 * s).to(QO.dtype.element_ty), mask=mq)
    tl.store(qo + HALF, (q2 * c + q1 * s).to(QO.dtype.element_ty), mask=mq)
    hk = tl.arange(0, BLOCK_HKV)[:, None]
    mk = hk < HKV
    k1 = tl.load(K + t * sk + hk * (2 * HALF) + i[None, :], mask=mk, other=0.0).to(tl.float32)
    k2 = tl.load(K + t * sk + hk * (2 * HALF) + HALF + i[None, :], mask=mk, other=0.0).to(tl.float32)
    ko = KC + slot * kc_s + wpos * kc_l + hk * kc_h + i[None, :]
    tl.store(ko, (k1 * c - k2 * s).to(KC.dtype.element_ty), mask=mk)
    tl.store(ko + HALF, (k2 * c + k1 * s).to(KC.dtype.element_ty), mask=mk)
    v1 = tl.load(V + t * sv + hk * (2 * HALF) + i[None, :], mask=mk, other=0.0)
    v2 = tl.load(V + t * sv + hk * (2 * HALF) + HALF + i[None, :], mask=mk, other=0.0)
    vo = VC + slot * vc_s + wpos * vc_l + hk * vc_h + i[None, :]
    tl.store(vo, v1.to(VC.dtype.element_ty), mask=mk)
    tl.store(vo + HALF, v2.to(VC.dtype.element_ty), mask=mk)


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_half: torch.Tensor, sin_half: torch.Tensor,
               positions: torch.Tensor, write_positions: torch.Tensor, slots: torch.Tensor,
               key_cache: torch.Tensor, value_cache: torch.Tensor, *, layout: str) -> torch.Tensor:
    """Rotate ``q`` ``[N, Hq*D]`` and ``k`` ``[N, Hkv*D]`` at ``positions`` (``cos_half``/``sin_half``:
    ``[L, D/2]`` float32 tables), store k and ``v`` into ``key_cache``/``value_cache`` (one layer of a
    :class:`~agentrl.engines.decode.slot_cache.SlotCache`, ``layout`` ``"token"`` or ``"head"``) at
    ``(slots, write_positions)``; returns the rotated q as ``[N, Hq, D]``. Rows of q/k/v must have a
    contiguous last dimension (views of a fused projection are fine)."""
    n = q.shape[0]
    half = cos_half.shape[1]
    d = 2 * half
    hq, hkv = q.shape[1] // d, k.shape[1] // d
    qo = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    if layout == "token":  # [S, L, Hkv, D]
        kc = (key_cache.stride(0), key_cache.stride(1), key_cache.stride(2))
        vc = (value_cache.stride(0), value_cache.stride(1), value_cache.stride(2))
    else:  # [S, Hkv, L, D]
        kc = (key_cache.stride(0), key_cache.stride(2), key_cache.stride(1))
        vc = (value_cache.stride(0), value_cache.stride(2), value_cache.stride(1))
    _rope_store_kernel[(n,)](
        q, k, v, cos_half, sin_half, positions, write_positions, slots, qo, key_cache, value_cache,
        q.stride(0), k.stride(0), v.stride(0), cos_half.stride(0), qo.stride(0), *kc, *vc,
        HQ=hq, HKV=hkv, HALF=half, BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HKV=triton.next_power_of_2(hkv),
        num_warps=2,
    )
    return qo


@triton.jit
def _silu_mul_kernel(GU, OUT, stride_gu, stride_out, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty).to(tl.float32)
    tl.store(OUT + row * stride_out + cols, (a * u).to(OUT.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[:, :I]) * gate_up[:, I:]`` for ``gate_up`` ``[N, 2I]``; returns ``[N, I]``."""
    n, two_i = gate_up.shape
    width = two_i // 2
    out = torch.empty((n, width), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(width))
    _silu_mul_kernel[(n, triton.cdiv(width, block))](gate_up, out, gate_up.stride(0), out.stride(0), width,
                                                     BLOCK=block, num_warps=4)
    return out
