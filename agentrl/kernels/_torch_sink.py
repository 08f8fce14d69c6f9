"""Sink attention in torch ops: the last backend of ``sink_attention(backend="auto")``, taken when a
kernel fails to compile or launch (see :mod:`agentrl.kernels.fallback`).

It computes the same function as the Triton kernels on every layout they take (dense ``[B, H, N, D]``,
packed ``[total, H, D]`` with ``cu_seqlens``/``cu_seqlens_k``, ``Nq < Nk`` bottom-right aligned, sliding
windows, GQA, with or without sinks, the LSE), in float32, and its gradients (d sink and the LSE's
included) by recomputation under autograd. Work is split into chunks of sequences, KV heads and query
rows of at most :data:`CHUNK_ELEMENTS` scores, so memory stays bounded at long contexts. The forward
is made of tensor ops on device tensors without host synchronisation, as the decode engine's captured
CUDA graphs need (not yet exercised on a GPU). It is much slower than the kernels: a way to keep a run
going, not a fast path.
"""

from __future__ import annotations

import torch

#: Scores per chunk (float32): the recomputation in the backward holds a few tensors of this size.
CHUNK_ELEMENTS = 1 << 25


class _Geometry:
    """Sequences of one call as padded ``[S, M, ...]`` blocks: ``n_q``/``n_k`` ``[S]`` lengths and, for the
    packed layout, the token index of each padded slot (invalid slots point at an appended zero row)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, cu_q, cu_k, lay) -> None:
        self.varlen, self.lay = lay.varlen, lay
        dev = q.device
        if lay.varlen:
            n_q = (cu_q[1:] - cu_q[:-1]).long()
            n_k = (cu_k[1:] - cu_k[:-1]).long()
            self.idx_q = self._index(cu_q[:-1].long(), n_q, lay.n_q, q.shape[0])
            self.idx_k = self._index(cu_k[:-1].long(), n_k, lay.n_k, k.shape[0])
        else:
            n_q = torch.full((lay.batch,), lay.n_q, dtype=torch.long, device=dev)
            n_k = torch.full((lay.batch,), lay.n_k, dtype=torch.long, device=dev)
        self.n_q, self.n_k = n_q, n_k

    @staticmethod
    def _index(starts: torch.Tensor, lengths: torch.Tensor, width: int, total: int) -> torch.Tensor:
        cols = torch.arange(width, device=starts.device)
        return torch.where(cols[None, :] < lengths[:, None], starts[:, None] + cols[None, :], total)

    @staticmethod
    def pad(t: torch.Tensor, lse_like: bool = False) -> torch.Tensor:
        """Append the zero row (token) that invalid packed slots read."""
        if lse_like:  # [H, total]
            return torch.cat([t, t.new_zeros(t.shape[0], 1)], dim=1)
        return torch.cat([t, t.new_zeros(1, *t.shape[1:])], dim=0)

    def take(self, t: torch.Tensor, keys: bool, s: slice, h: slice, r: slice) -> torch.Tensor:
        """``[s, h, r, D]`` of a q/k/v-like tensor (packed ones already :meth:`pad`-ed)."""
        if not self.varlen:
            return t[s, h, r]
        idx = (self.idx_k if keys else self.idx_q)[s, r]
        return t[idx][:, :, h].permute(0, 2, 1, 3)

    def take_lse(self, t: torch.Tensor, s: slice, h: slice, r: slice) -> torch.Tensor:
        """``[s, h, r]`` of an LSE-like tensor (packed: ``[H, total + 1]``)."""
        if not self.varlen:
            return t[s, h, r]
        return t[h][:, self.idx_q[s, r]].permute(1, 0, 2)

    def put(self, dest: torch.Tensor, vals: torch.Tensor, keys: bool, s: slice, h: slice, r: slice,
            accumulate: bool) -> None:
        """Write (or with ``accumulate`` add) ``vals`` (``[s, h, r, D]``) into a (padded, for packed)
        q/k/v-like tensor; without ``accumulate`` the padding row receives arbitrary values."""
        if not self.varlen:
            if accumulate:
                dest[s, h, r] += vals
            else:
                dest[s, h, r] = vals
            return
        idx = (self.idx_k if keys else self.idx_q)[s, r].reshape(-1)
        dest[:, h].index_put_((idx,), vals.permute(0, 2, 1, 3).reshape(idx.numel(), *vals.shape[1:2], -1),
                              accumulate=accumulate)

    def put_lse(self, dest: torch.Tensor, vals: torch.Tensor, s: slice, h: slice, r: slice) -> None:
        """Write ``vals`` (``[s, h, r]``) into an LSE-like tensor (packed: ``[H, total + 1]``)."""
        if not self.varlen:
            dest[s, h, r] = vals
            return
        idx = self.idx_q[s, r].reshape(-1)
        dest.t()[:, h].index_put_((idx,), vals.permute(0, 2, 1).reshape(idx.numel(), -1))

    def chunks(self, group: int):
        """``(sequences, KV heads, query rows)`` slices of at most :data:`CHUNK_ELEMENTS` scores."""
        lay = self.lay
        per_row = group * max(lay.n_k, 1)
        rows = max(1, min(lay.n_q, CHUNK_ELEMENTS // per_row))
        heads = max(1, min(lay.hkv, CHUNK_ELEMENTS // (per_row * rows)))
        seqs = max(1, min(lay.batch, CHUNK_ELEMENTS // (per_row * rows * heads)))
        for s0 in range(0, lay.batch, seqs):
            for h0 in range(0, lay.hkv, heads):
                for r0 in range(0, max(lay.n_q, 1), rows):
                    yield slice(s0, s0 + seqs), slice(h0, h0 + heads), slice(r0, r0 + rows)


def _attend(q, k, v, sink, n_q, n_k, r0: int, causal: bool, window: int | None, scale: float):
    """One chunk in float32: ``q`` ``[S, Hkv*G, R, D]`` (query rows ``r0 ..``), ``k``/``v`` ``[S, Hkv, M, D]``,
    ``sink`` ``[Hkv*G]`` or None, ``n_q``/``n_k`` ``[S]``; returns ``out`` ``[S, Hkv*G, R, D]``, ``lse``
    ``[S, Hkv*G, R]`` (a row that sees nothing: ``out = 0``, ``lse = sink`` or ``-inf``)."""
    s_n, hq, rows, d = q.shape
    hkv, m = k.shape[1], k.shape[2]
    group = hq // hkv
    i = torch.arange(r0, r0 + rows, device=q.device)[None, :, None]
    j = torch.arange(m, device=q.device)[None, None, :]
    pos = (n_k - n_q)[:, None, None] + i
    ok = (i < n_q[:, None, None]) & (j < n_k[:, None, None])
    if causal:
        ok = ok & (j <= pos)
    if window is not None:
        ok = ok & (j > pos - window)
    scores = torch.matmul(q.reshape(s_n, hkv, group * rows, d), k.transpose(-1, -2)) * scale
    scores = scores.reshape(s_n, hq, rows, m).masked_fill(~ok[:, None], float("-inf"))
    top = scores.amax(dim=-1)
    if sink is not None:
        top = torch.maximum(top, sink.view(1, -1, 1))
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top)).detach()  # exact: lse does not depend on it
    weights = torch.exp(scores - top[..., None])
    denom = weights.sum(dim=-1)
    if sink is not None:
        denom = denom + torch.exp(sink.view(1, -1, 1) - top)
    seen = denom > 0
    safe = torch.where(seen, denom, torch.ones_like(denom))
    out = torch.matmul(weights.reshape(s_n, hkv, group * rows, m), v).reshape(s_n, hq, rows, d) / safe[..., None]
    lse = torch.where(seen, top + torch.log(safe), torch.full_like(top, float("-inf")))
    return out, lse


def _chunk_inputs(geo: _Geometry, tensors, s: slice, hk: slice, r: slice, group: int):
    q, k, v = tensors
    hq = slice(hk.start * group, hk.stop * group)
    return (geo.take(q, False, s, hq, r).float(), geo.take(k, True, s, hk, slice(None)).float(),
            geo.take(v, True, s, hk, slice(None)).float(), hq)


def torch_sink_forward(q, k, v, sinks32, cu_q, cu_k, lay, causal: bool, window: int | None, scale: float):
    """``(out, lse)`` as :func:`agentrl.kernels.sink_attention` returns them (``out`` in ``q``'s dtype and
    layout, ``lse`` float32), without autograd."""
    geo = _Geometry(q, k, cu_q, cu_k, lay)
    group = lay.hq // lay.hkv
    with torch.no_grad():
        src = (geo.pad(q), geo.pad(k), geo.pad(v)) if lay.varlen else (q, k, v)
        out = torch.zeros(src[0].shape, device=q.device, dtype=torch.float32)
        lse_shape = (lay.hq, q.shape[0] + 1) if lay.varlen else (lay.batch, lay.hq, lay.n_q)
        lse = torch.zeros(lse_shape, device=q.device, dtype=torch.float32)
        for s, hk, r in geo.chunks(group):
            qc, kc, vc, hq = _chunk_inputs(geo, src, s, hk, r, group)
            o, lse_c = _attend(qc, kc, vc, None if sinks32 is None else sinks32[hq], geo.n_q[s], geo.n_k[s],
                               r.start, causal, window, scale)
            geo.put(out, o, False, s, hq, r, accumulate=False)
            geo.put_lse(lse, lse_c, s, hq, r)
    if lay.varlen:
        out, lse = out[:-1], lse[:, :-1].contiguous()
    return out.to(q.dtype), lse


def torch_sink_backward(dout, dlse, q, k, v, sinks32, cu_q, cu_k, lay, causal: bool, window: int | None,
                        scale: float):
    """``(dq, dk, dv, dsink)`` of :func:`torch_sink_forward` for upstream ``dout`` (and ``dlse``, or None),
    recomputing each chunk under autograd; ``dsink`` is float32 (None without sinks)."""
    geo = _Geometry(q, k, cu_q, cu_k, lay)
    group = lay.hq // lay.hkv
    pad = geo.pad if lay.varlen else (lambda t, lse_like=False: t)
    src = (pad(q), pad(k), pad(v))
    grads = [torch.zeros(t.shape, device=t.device, dtype=torch.float32) for t in src]
    dsink = torch.zeros_like(sinks32) if sinks32 is not None else None
    dout = pad(dout)
    dlse = pad(dlse, lse_like=True) if dlse is not None else None
    for s, hk, r in geo.chunks(group):
        with torch.enable_grad():
            qc, kc, vc, hq = _chunk_inputs(geo, src, s, hk, r, group)
            leaves = [t.detach().requires_grad_() for t in (qc, kc, vc)]
            if sinks32 is not None:
                leaves.append(sinks32[hq].detach().clone().requires_grad_())
            o, lse_c = _attend(*leaves[:3], leaves[3] if sinks32 is not None else None, geo.n_q[s], geo.n_k[s],
                               r.start, causal, window, scale)
            outs, ups = [o], [geo.take(dout, False, s, hq, r).float()]
            if dlse is not None:
                outs.append(lse_c)
                ups.append(geo.take_lse(dlse, s, hq, r).float())
            got = torch.autograd.grad(outs, leaves, ups)
        geo.put(grads[0], got[0], False, s, hq, r, accumulate=True)
        geo.put(grads[1], got[1], True, s, hk, slice(None), accumulate=True)
        geo.put(grads[2], got[2], True, s, hk, slice(None), accumulate=True)
        if dsink is not None:
            dsink[hq] += got[3]
    if lay.varlen:
        grads = [g[:-1] for g in grads]
    return (*(g.to(t.dtype) for g, t in zip(grads, (q, k, v), strict=True)), dsink)


class TorchSinkFn(torch.autograd.Function):
    """:func:`torch_sink_forward` with :func:`torch_sink_backward` as its gradient (the arguments of
    ``_SinkAttentionFn``, ``sinks`` in any float dtype)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_q, cu_k, lay, causal, window, scale):
        sinks32 = sinks.detach().float() if sinks is not None else None
        out, lse = torch_sink_forward(q, k, v, sinks32, cu_q, cu_k, lay, causal, window, scale)
        ctx.save_for_backward(q, k, v, sinks32, cu_q, cu_k)
        ctx.meta = (lay, causal, window, scale, None if sinks is None else sinks.dtype)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, sinks32, cu_q, cu_k = ctx.saved_tensors
        lay, causal, window, scale, sink_dtype = ctx.meta
        if dout is None:
            dout = torch.zeros_like(q)
        dq, dk, dv, dsink = torch_sink_backward(dout, dlse, q, k, v, sinks32, cu_q, cu_k, lay, causal, window,
                                                scale)
        return dq, dk, dv, None if dsink is None else dsink.to(sink_dtype), None, None, None, None, None, None
