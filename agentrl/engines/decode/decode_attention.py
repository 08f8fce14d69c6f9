"""An exact float32 decode-attention kernel (Triton) over the ``head`` layout of the slot cache.

The sink-attention kernels of :mod:`agentrl.kernels` run float32 dot products as TF32 (10-bit mantissas),
which would put a ~1e-3 gap between the rollout's log-probs and the trainer's float32 recomputation.
This kernel computes one query per row with IEEE float32 dot products, reading only the keys each row
sees (``n_keys``, limited to the last ``window`` on sliding layers) from its own slot, with an optional
per-head sink logit in the normaliser. One program per (row, KV head) handles the KV head's whole query
group. It is what float32 dense models decode with on a GPU; it also runs under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_kernel(Q, K, V, SINK, OUT, SLOT, NKEYS, sq_r, sq_h, sk_s, sk_h, sk_l, sv_s, sv_h, sv_l, so_r, so_h,
                   window, scale, G: tl.constexpr, G_P: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                   HAS_SINK: tl.constexpr, WINDOW: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1).to(tl.int64)
    slot = tl.load(SLOT + r).to(tl.int64)
    nk = tl.load(NKEYS + r).to(tl.int64)
    g = tl.arange(0, G_P)
    mg = g < G
    heads = hk * G + g
    d = tl.arange(0, D)
    q = tl.load(Q + r * sq_r + heads[:, None] * sq_h + d[None, :], mask=mg[:, None], other=0.0).to(tl.float32)
    if HAS_SINK:
        m = tl.load(SINK + heads, mask=mg, other=0.0).to(tl.float32)
        l_sum = tl.full([G_P], 1.0, dtype=tl.float32)
    else:
        m = tl.full([G_P], -1.0e30, dtype=tl.float32)
        l_sum = tl.zeros([G_P], dtype=tl.float32)
    acc = tl.zeros([G_P, D], dtype=tl.float32)
    lo = nk * 0
    if WINDOW:
        lo = tl.maximum(nk - window, 0)
    k_base = K + slot * sk_s + hk * sk_h
    v_base = V + slot * sv_s + hk * sv_h
    for start in range(lo, nk, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mk = cols < nk
        k = tl.load(k_base + cols[:, None] * sk_l + d[None, :], mask=mk[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_base + cols[:, None] * sv_l + d[None, :], mask=mk[:, None], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        s = tl.where(mk[None, :], s, -1.0e30)
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m = m_new
    out = acc / l_sum[:, None]
    tl.store(OUT + r * so_r + heads[:, None] * so_h + d[None, :], out.to(OUT.dtype.element_ty), mask=mg[:, None])


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                     n_keys: torch.Tensor, *, sinks: torch.Tensor | None, window: int | None,
                     scale: float) -> torch.Tensor:
    """``q`` ``[R, Hq, D]`` (one query per row); ``keys``/``values`` one layer of a ``head``-layout slot
    cache, ``[S, Hkv, L, D]``; row ``r`` reads slot ``slots[r]``'s first ``n_keys[r]`` positions (>= 1).
    Returns ``[R, Hq, D]`` in ``q``'s dtype."""
    rows, hq, d = q.shape
    hkv = keys.shape[1]
    group = hq // hkv
    out = torch.empty_like(q)
    sink = sinks if sinks is not None else q
    _decode_kernel[(rows, hkv)](
        q, keys, values, sink, out, slots, n_keys, q.stride(0), q.stride(1), keys.stride(0), keys.stride(1),
        keys.stride(2), values.stride(0), values.stride(1), values.stride(2), out.stride(0), out.stride(1),
        int(window or 0), float(scale), G=group, G_P=max(16, triton.next_power_of_2(group)), D=d, BLOCK_N=32,
        HAS_SINK=sinks is not None, WINDOW=window is not None, num_warps=4,
    )
    return out
