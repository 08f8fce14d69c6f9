"""Triton kernels for attention with a per-head sink logit (GPT-OSS).

Imported lazily by :mod:`agentrl.kernels.sink_attention`, so that ``import agentrl.kernels`` works
without Triton. All kernels work on one generic layout: every tensor is addressed through
(batch, head, token) strides with a contiguous last dimension, and with ``VARLEN`` the batch index
selects a sequence of a packed tensor through ``cu_seqlens`` (batch stride 0).

Conventions shared by all kernels:

* A query row ``r`` of a sequence with ``n_q`` queries and ``n_k`` keys sits at key position
  ``r + n_k - n_q`` (bottom-right alignment, as with a KV cache). Causal: key ``j`` is visible iff
  ``j <= pos``; window ``W``: also ``j > pos - W`` (``W`` keys including the query itself).
* Scores are kept in the log2 domain: ``s2 = (q . k) * scale * log2(e)``; the sink enters as
  ``sigma * log2(e)`` (raw, not scaled). The stored LSE is natural-log and includes the sink.
* Every KV range is split into masked edge blocks and an unmasked middle, so the mask arithmetic
  runs only where a block straddles the causal diagonal, the window edge or the sequence end.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _seq_bounds(CU_Q, CU_K, b, n_q_dense, n_k_dense, VARLEN: tl.constexpr):
    """Start offsets (in tokens) and lengths of sequence ``b`` for queries and keys."""
    if VARLEN:
        q_start = tl.load(CU_Q + b)
        n_q = tl.load(CU_Q + b + 1) - q_start
        k_start = tl.load(CU_K + b)
        n_k = tl.load(CU_K + b + 1) - k_start
    else:
        q_start = b * 0  # a tensor, not a constexpr, so that .to(int64) works below
        n_q = n_q_dense
        k_start = b * 0
        n_k = n_k_dense
    return q_start, n_q, k_start, n_k


@triton.jit
def _kv_ranges(m0, n_k, off, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """KV blocks seen by query rows [m0, m0+BLOCK_M): [lo, full_lo) masked, [full_lo, full_hi)
    unmasked, [full_hi, hi) masked. All block starts are multiples of BLOCK_N."""
    lo = 0
    hi = n_k
    full_lo = 0
    full_hi = (n_k // BLOCK_N) * BLOCK_N
    if CAUSAL:
        hi = tl.minimum(n_k, m0 + BLOCK_M + off)
        full_hi = (tl.minimum(m0 + off + 1, n_k) // BLOCK_N) * BLOCK_N
    if WINDOW:
        lo = (tl.maximum(m0 + off - window + 1, 0) // BLOCK_N) * BLOCK_N
        full_lo = tl.maximum(((m0 + BLOCK_M + off - window + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, lo)
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(full_lo, hi)
    full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _q_ranges(n0, n_q, n_k, off, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """Query blocks that see keys [n0, n0+BLOCK_N), split like :func:`_kv_ranges` (starts are
    multiples of BLOCK_M)."""
    lo = 0
    hi = n_q
    full_lo = 0
    full_hi = (n_q // BLOCK_M) * BLOCK_M
    if CAUSAL:
        lo = (tl.maximum(n0 - off, 0) // BLOCK_M) * BLOCK_M
        full_lo = ((tl.maximum(n0 + BLOCK_N - 1 - off, 0) + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    if WINDOW:
        hi = tl.minimum(n_q, n0 + BLOCK_N - 1 + window - off)
        full_hi = (tl.minimum(n_q, n0 + window - off) // BLOCK_M) * BLOCK_M
    if n0 + BLOCK_N > n_k:  # key tail: every block needs the key-length mask
        full_lo = hi
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _visible(rows_pos, cols, n_k, window, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """[BLOCK_M, BLOCK_N] visibility of keys ``cols`` for queries at positions ``rows_pos``."""
    ok = cols[None, :] < n_k
    if CAUSAL:
        ok = ok & (cols[None, :] <= rows_pos[:, None])
    if WINDOW:
        ok = ok & (cols[None, :] > rows_pos[:, None] - window)
    return ok


@triton.jit
def _row_map(p0, h0, BLOCK_M: tl.constexpr, PACK: tl.constexpr):
    """Rows of a tile: ``PACK`` query heads (from ``h0``) times ``BLOCK_M // PACK`` positions (from
    ``p0``), head-major. PACK > 1 packs the query heads of a GQA group into one tile: they share the
    K/V tiles and, having the same positions, the same causal/window range."""
    r = tl.arange(0, BLOCK_M)
    heads = h0 + r // (BLOCK_M // PACK)
    pos = p0 + r % (BLOCK_M // PACK)
    return heads, pos


@triton.jit
def _desc_tile(desc, b, hk, k_start, start_n, cols, n_k, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
               MASKED: tl.constexpr, VARLEN: tl.constexpr):
    """[BLOCK_N, HEAD_D] rows ``start_n..`` of KV head ``hk`` through a tensor descriptor (dense
    ``[B, H, N, D]``: rows past the end read as zero; packed ``[total, H, D]``: rows past the
    sequence belong to the next one or to unused memory and are zeroed in masked blocks)."""
    if VARLEN:
        t = desc.load([k_start + start_n, hk, 0]).reshape(BLOCK_N, HEAD_D)
        if MASKED:
            t = tl.where(cols[:, None] < n_k, t, 0.0)
    else:
        t = desc.load([b, hk, start_n, 0]).reshape(BLOCK_N, HEAD_D)
    return t


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_ptr, v_ptr, k_desc, v_desc, stride_kn, stride_vn, rows_pos, start, end,
               n_k, b, hk, k_start, qk_scale2, window, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, TMA: tl.constexpr,
               VARLEN: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_D)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        if TMA:
            kt = tl.trans(_desc_tile(k_desc, b, hk, k_start, start_n, cols, n_k, BLOCK_N, HEAD_D, MASKED,
                                     VARLEN))
            v = _desc_tile(v_desc, b, hk, k_start, start_n, cols, n_k, BLOCK_N, HEAD_D, MASKED, VARLEN)
        else:
            kt_ptrs = k_ptr + cols[None, :] * stride_kn + offs_d[:, None]
            v_ptrs = v_ptr + cols[:, None] * stride_vn + offs_d[None, :]
            if MASKED:
                kt = tl.load(kt_ptrs, mask=cols[None, :] < n_k, other=0.0)
                v = tl.load(v_ptrs, mask=cols[:, None] < n_k, other=0.0)
            else:
                kt = tl.load(kt_ptrs)
                v = tl.load(v_ptrs)
        s = tl.dot(q, kt)
        if MASKED:
            s = tl.where(_visible(rows_pos, cols, n_k, window, CAUSAL, WINDOW), s, float("-inf"))
        # scale folded into the exponent: one FMA per score
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale2)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s * qk_scale2 - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def sink_fwd_kernel(Q, K, V, SINK, Out, LSE, CU_Q, CU_K, K_DESC, V_DESC,
                    sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_h, so_n,
                    sl_b, sl_h, n_q_dense, n_k_dense, H, GROUP, qk_scale2, window,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
                    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
                    HAS_SINK: tl.constexpr, PACK: tl.constexpr, TMA: tl.constexpr):
    """Grid: (position blocks of BLOCK_M // PACK, B * H // PACK). ``TMA``: K/V tiles come through the
    tensor descriptors ``K_DESC``/``V_DESC`` (block ``[1, 1, BLOCK_N, D]`` dense, ``[BLOCK_N, 1, D]``
    packed) instead of pointer loads."""
    BLOCK_P: tl.constexpr = BLOCK_M // PACK
    # Longest blocks first: under causal masking the last query blocks do the most work.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // (H // PACK)
    h0 = (pid_bh % (H // PACK)) * PACK
    hk = h0 // GROUP
    q_start, n_q, k_start, n_k = _seq_bounds(CU_Q, CU_K, b, n_q_dense, n_k_dense, VARLEN)
    p0 = pid_m * BLOCK_P
    if p0 >= n_q:
        return
    off = n_k - n_q
    b64 = b.to(tl.int64)
    heads, pos = _row_map(p0, h0, BLOCK_M, PACK)
    heads64 = heads.to(tl.int64)
    tok64 = (q_start + pos).to(tl.int64)
    k_ptr = K + b64 * sk_b + hk.to(tl.int64) * sk_h + k_start.to(tl.int64) * sk_n
    v_ptr = V + b64 * sv_b + hk.to(tl.int64) * sv_h + k_start.to(tl.int64) * sv_n
    offs_d = tl.arange(0, HEAD_D)
    row_ok = pos < n_q
    q_rows = Q + b64 * sq_b + heads64 * sq_h + tok64 * sq_n
    q = tl.load(q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    rows_pos = pos + off

    # Running max starts at the sink, so fully masked tiles never produce exp(-inf - -inf).
    if HAS_SINK:
        sink2 = tl.load(SINK + heads).to(tl.float32) * 1.4426950408889634
    else:
        sink2 = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    m_i = tl.maximum(sink2, -1.0e30)
    l_i = tl.exp2(sink2 - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_D], dtype=tl.float32)

    lo, full_lo, full_hi, hi = _kv_ranges(p0, n_k, off, window, BLOCK_P, BLOCK_N, CAUSAL, WINDOW)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptr, v_ptr, K_DESC, V_DESC, sk_n, sv_n, rows_pos, lo,
                               full_lo, n_k, b, hk, k_start, qk_scale2, window, BLOCK_N, HEAD_D, True,
                               CAUSAL, WINDOW, TMA, VARLEN)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptr, v_ptr, K_DESC, V_DESC, sk_n, sv_n, rows_pos,
                               full_lo, full_hi, n_k, b, hk, k_start, qk_scale2, window, BLOCK_N, HEAD_D,
                               False, CAUSAL, WINDOW, TMA, VARLEN)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptr, v_ptr, K_DESC, V_DESC, sk_n, sv_n, rows_pos,
                               full_hi, hi, n_k, b, hk, k_start, qk_scale2, window, BLOCK_N, HEAD_D, True,
                               CAUSAL, WINDOW, TMA, VARLEN)

    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # only without a sink and with no visible key
    out = acc / l_i[:, None]
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
    o_rows = Out + b64 * so_b + heads64 * so_h + tok64 * so_n
    tl.store(o_rows[:, None] + offs_d[None, :], out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + b64 * sl_b + heads64 * sl_h + tok64, lse, mask=row_ok)


@triton.jit
def sink_bwd_preprocess_kernel(Out, DO, LSE, DLSE, SINK, DELTA, SINKTERM, CU_Q, CU_K,
                               so_b, so_h, so_n, sdo_b, sdo_h, sdo_n, sl_b, sl_h,
                               n_q_dense, n_k_dense, H,
                               BLOCK_M: tl.constexpr, HEAD_D: tl.constexpr, VARLEN: tl.constexpr,
                               HAS_DLSE: tl.constexpr, HAS_SINK: tl.constexpr):
    """DELTA_i = dO_i . O_i - dL_i and SINKTERM_i = p_i * DELTA_i (p_i = exp(sigma - L_i)), one per row,
    so that d(sigma) = -sum_i SINKTERM_i is a deterministic reduction done outside."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    q_start, n_q, k_start, n_k = _seq_bounds(CU_Q, CU_K, b, n_q_dense, n_k_dense, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= n_q:
        return
    b64 = b.to(tl.int64)
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    row_ok = rows < n_q
    o_ptr = Out + b64 * so_b + h.to(tl.int64) * so_h + q_start.to(tl.int64) * so_n
    do_ptr = DO + b64 * sdo_b + h.to(tl.int64) * sdo_h + q_start.to(tl.int64) * sdo_n
    l_off = b64 * sl_b + h.to(tl.int64) * sl_h + q_start + rows
    o = tl.load(o_ptr + rows[:, None] * so_n + offs_d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(do_ptr + rows[:, None] * sdo_n + offs_d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + l_off, mask=row_ok, other=0.0)
    tl.store(DELTA + l_off, delta, mask=row_ok)
    if HAS_SINK:
        lse = tl.load(LSE + l_off, mask=row_ok, other=0.0)
        p_sink = tl.exp(tl.load(SINK + h).to(tl.float32) - lse)
        tl.store(SINKTERM + l_off, p_sink * delta, mask=row_ok)


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, q_rows, do_rows, dq_rows, l_rows, start, end, sq_n, sdo_n, sdq_n, cols,
                    n_q, n_k, off, qk_scale2, sm_scale, window, q_desc, do_desc, dq_desc, b, h, q_start,
                    BLOCK_M: tl.constexpr, HEAD_D: tl.constexpr, PACK: tl.constexpr, MASKED: tl.constexpr,
                    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, ATOMIC_DQ: tl.constexpr, TMA: tl.constexpr,
                    DQ_TMA: tl.constexpr, VARLEN: tl.constexpr, LSE, DELTA):
    """Accumulate dK, dV of one KV tile over query position blocks [start, end). ``q_rows``,
    ``do_rows``, ``dq_rows``, ``l_rows``: base pointers/offsets of the head(s), a scalar for
    PACK == 1 and one per row otherwise; positions are added here. ``ATOMIC_DQ``: also add this
    tile's share of dQ (``scale * dS K``) into the fp32 buffer at ``dq_rows`` with atomics, so that
    no second kernel has to recompute P for dQ. ``TMA`` (PACK == 1): q and dO tiles through the
    descriptors ``q_desc``/``do_desc`` of head ``h``; ``DQ_TMA`` (dense): the dQ share is added by
    a bulk tensor reduction through ``dq_desc`` instead of one atomic per element."""
    BLOCK_P: tl.constexpr = BLOCK_M // PACK
    offs_d = tl.arange(0, HEAD_D)
    if PACK == 1:
        rpos = tl.arange(0, BLOCK_M)
    else:
        rpos = tl.arange(0, BLOCK_M) % BLOCK_P
    for start_m in range(start, end, BLOCK_P):
        pos = start_m + rpos
        row_ok = pos < n_q
        if TMA:
            if VARLEN:
                q = q_desc.load([q_start + start_m, h, 0]).reshape(BLOCK_M, HEAD_D)
                do = do_desc.load([q_start + start_m, h, 0]).reshape(BLOCK_M, HEAD_D)
                if MASKED:  # rows past the sequence: another sequence's, or unused memory
                    q = tl.where(row_ok[:, None], q, 0.0)
                    do = tl.where(row_ok[:, None], do, 0.0)
            else:
                q = q_desc.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_D)
                do = do_desc.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_D)
        else:
            if PACK == 1:
                q_ptrs = q_rows + pos[:, None] * sq_n + offs_d[None, :]
                do_ptrs = do_rows + pos[:, None] * sdo_n + offs_d[None, :]
            else:
                q_ptrs = q_rows[:, None] + pos[:, None].to(tl.int64) * sq_n + offs_d[None, :]
                do_ptrs = do_rows[:, None] + pos[:, None].to(tl.int64) * sdo_n + offs_d[None, :]
            if MASKED:
                q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
                do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
            else:
                q = tl.load(q_ptrs)
                do = tl.load(do_ptrs)
        if MASKED:
            lse = tl.load(LSE + l_rows + pos, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + l_rows + pos, mask=row_ok, other=0.0)
        else:
            lse = tl.load(LSE + l_rows + pos)
            delta = tl.load(DELTA + l_rows + pos)
        s_t = tl.dot(k, tl.trans(q))  # [BLOCK_N, BLOCK_M]
        p_t = tl.exp2(s_t * qk_scale2 - (lse * 1.4426950408889634)[None, :])
        if MASKED:
            ok = tl.trans(_visible(pos + off, cols, n_k, window, CAUSAL, WINDOW)) & row_ok[None, :]
            p_t = tl.where(ok, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk = tl.dot(ds_t, q, dk)
        if ATOMIC_DQ:
            dq_part = tl.dot(tl.trans(ds_t), k) * sm_scale  # [BLOCK_M, HEAD_D], fp32
            if DQ_TMA:  # rows past the end are clipped; masked rows add exact zeros
                dq_desc.atomic_add([b, h, start_m, 0], dq_part.reshape(1, 1, BLOCK_M, HEAD_D))
            else:
                if PACK == 1:
                    dq_ptrs = dq_rows + pos[:, None] * sdq_n + offs_d[None, :]
                else:
                    dq_ptrs = dq_rows[:, None] + pos[:, None].to(tl.int64) * sdq_n + offs_d[None, :]
                if MASKED:
                    tl.atomic_add(dq_ptrs, dq_part, mask=row_ok[:, None], sem="relaxed")
                else:
                    tl.atomic_add(dq_ptrs, dq_part, sem="relaxed")
    return dk, dv


@triton.jit
def sink_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DQ, CU_Q, CU_K, Q_DESC, DO_DESC, DQ_DESC,
                         sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sdo_b, sdo_h, sdo_n,
                         sdk_b, sdk_h, sdk_n, sdv_b, sdv_h, sdv_n, sdq_b, sdq_h, sdq_n, sl_b, sl_h,
                         n_q_dense, n_k_dense, HKV, GROUP, qk_scale2, sm_scale, window,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
                         CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
                         PACK: tl.constexpr, ATOMIC_DQ: tl.constexpr, TMA: tl.constexpr,
                         DQ_TMA: tl.constexpr):
    """One program per (KV block, batch, KV head); it covers the GROUP query heads that share the KV
    head (PACK of them per tile), so dK and dV are summed over the group without atomics. With
    ``ATOMIC_DQ`` it also accumulates dQ (fp32, pre-zeroed ``DQ``) by atomics: 5 matmuls per tile
    instead of 4 here plus 3 in :func:`sink_bwd_dq_kernel`. ``TMA``/``DQ_TMA``: see
    :func:`_bwd_dkdv_inner` (descriptors ``[1, 1, BLOCK_M, D]`` dense, ``[BLOCK_M, 1, D]`` packed)."""
    BLOCK_P: tl.constexpr = BLOCK_M // PACK
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HKV
    hk = pid_bh % HKV
    q_start, n_q, k_start, n_k = _seq_bounds(CU_Q, CU_K, b, n_q_dense, n_k_dense, VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= n_k:
        return
    off = n_k - n_q
    b64 = b.to(tl.int64)
    cols = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_D)
    col_ok = cols < n_k
    k_ptr = K + b64 * sk_b + hk.to(tl.int64) * sk_h + k_start.to(tl.int64) * sk_n
    v_ptr = V + b64 * sv_b + hk.to(tl.int64) * sv_h + k_start.to(tl.int64) * sv_n
    k = tl.load(k_ptr + cols[:, None] * sk_n + offs_d[None, :], mask=col_ok[:, None], other=0.0)
    v = tl.load(v_ptr + cols[:, None] * sv_n + offs_d[None, :], mask=col_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_D], dtype=tl.float32)
    lo, full_lo, full_hi, hi = _q_ranges(n0, n_q, n_k, off, window, BLOCK_P, BLOCK_N, CAUSAL, WINDOW)
    q_base = Q + b64 * sq_b + q_start.to(tl.int64) * sq_n
    do_base = DO + b64 * sdo_b + q_start.to(tl.int64) * sdo_n
    dq_base = DQ + b64 * sdq_b + q_start.to(tl.int64) * sdq_n
    l_base = b64 * sl_b + q_start
    for hg in range(GROUP // PACK):
        if PACK == 1:  # one head: scalar bases keep the address arithmetic of a plain tile
            h64 = (hk * GROUP + hg).to(tl.int64)
            q_rows = q_base + h64 * sq_h
            do_rows = do_base + h64 * sdo_h
            dq_rows = dq_base + h64 * sdq_h
            l_rows = l_base + h64 * sl_h
        else:
            heads, _ = _row_map(0, hk * GROUP + hg * PACK, BLOCK_M, PACK)
            heads64 = heads.to(tl.int64)
            q_rows = q_base + heads64 * sq_h
            do_rows = do_base + heads64 * sdo_h
            dq_rows = dq_base + heads64 * sdq_h
            l_rows = l_base + heads64 * sl_h
        h = hk * GROUP + hg * PACK
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_rows, do_rows, dq_rows, l_rows, lo, full_lo, sq_n, sdo_n,
                                 sdq_n, cols, n_q, n_k, off, qk_scale2, sm_scale, window, Q_DESC, DO_DESC,
                                 DQ_DESC, b, h, q_start, BLOCK_M, HEAD_D, PACK, True, CAUSAL, WINDOW,
                                 ATOMIC_DQ, TMA, DQ_TMA, VARLEN, LSE, DELTA)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_rows, do_rows, dq_rows, l_rows, full_lo, full_hi, sq_n,
                                 sdo_n, sdq_n, cols, n_q, n_k, off, qk_scale2, sm_scale, window, Q_DESC,
                                 DO_DESC, DQ_DESC, b, h, q_start, BLOCK_M, HEAD_D, PACK, False, CAUSAL,
                                 WINDOW, ATOMIC_DQ, TMA, DQ_TMA, VARLEN, LSE, DELTA)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_rows, do_rows, dq_rows, l_rows, full_hi, hi, sq_n, sdo_n,
                                 sdq_n, cols, n_q, n_k, off, qk_scale2, sm_scale, window, Q_DESC, DO_DESC,
                                 DQ_DESC, b, h, q_start, BLOCK_M, HEAD_D, PACK, True, CAUSAL, WINDOW,
                                 ATOMIC_DQ, TMA, DQ_TMA, VARLEN, LSE, DELTA)
    dk = dk * sm_scale
    dk_ptr = DK + b64 * sdk_b + hk.to(tl.int64) * sdk_h + k_start.to(tl.int64) * sdk_n
    dv_ptr = DV + b64 * sdv_b + hk.to(tl.int64) * sdv_h + k_start.to(tl.int64) * sdv_n
    tl.store(dk_ptr + cols[:, None] * sdk_n + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(dv_ptr + cols[:, None] * sdv_n + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def _bwd_dq_inner(dq, q, do, lse2, delta, k_ptr, v_ptr, stride_kn, stride_vn, rows_pos, start, end, n_k,
                  qk_scale2, window, k_desc, v_desc, b, hk, k_start, BLOCK_N: tl.constexpr,
                  HEAD_D: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                  TMA: tl.constexpr, VARLEN: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_D)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        if TMA:
            k = _desc_tile(k_desc, b, hk, k_start, start_n, cols, n_k, BLOCK_N, HEAD_D, MASKED, VARLEN)
            v = _desc_tile(v_desc, b, hk, k_start, start_n, cols, n_k, BLOCK_N, HEAD_D, MASKED, VARLEN)
            kt = tl.trans(k)
            vt = tl.trans(v)
        else:
            kt_ptrs = k_ptr + cols[None, :] * stride_kn + offs_d[:, None]
            vt_ptrs = v_ptr + cols[None, :] * stride_vn + offs_d[:, None]
            if MASKED:
                kt = tl.load(kt_ptrs, mask=cols[None, :] < n_k, other=0.0)
                vt = tl.load(vt_ptrs, mask=cols[None, :] < n_k, other=0.0)
            else:
                kt = tl.load(kt_ptrs)
                vt = tl.load(vt_ptrs)
        s = tl.dot(q, kt)
        p = tl.exp2(s * qk_scale2 - lse2[:, None])
        if MASKED:
            p = tl.where(_visible(rows_pos, cols, n_k, window, CAUSAL, WINDOW), p, 0.0)
        dp = tl.dot(do, vt)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq)
    return dq


@triton.jit
def sink_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, CU_Q, CU_K, K_DESC, V_DESC,
                       sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sdo_b, sdo_h, sdo_n,
                       sdq_b, sdq_h, sdq_n, sl_b, sl_h, n_q_dense, n_k_dense, H, GROUP,
                       qk_scale2, sm_scale, window,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
                       CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
                       PACK: tl.constexpr, TMA: tl.constexpr):
    """Grid: (position blocks of BLOCK_M // PACK, B * H // PACK). ``TMA``: K/V tiles through the
    descriptors, as in the forward."""
    BLOCK_P: tl.constexpr = BLOCK_M // PACK
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // (H // PACK)
    h0 = (pid_bh % (H // PACK)) * PACK
    hk = h0 // GROUP
    q_start, n_q, k_start, n_k = _seq_bounds(CU_Q, CU_K, b, n_q_dense, n_k_dense, VARLEN)
    p0 = pid_m * BLOCK_P
    if p0 >= n_q:
        return
    off = n_k - n_q
    b64 = b.to(tl.int64)
    heads, pos = _row_map(p0, h0, BLOCK_M, PACK)
    heads64 = heads.to(tl.int64)
    tok64 = (q_start + pos).to(tl.int64)
    offs_d = tl.arange(0, HEAD_D)
    row_ok = pos < n_q
    q = tl.load((Q + b64 * sq_b + heads64 * sq_h + tok64 * sq_n)[:, None] + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load((DO + b64 * sdo_b + heads64 * sdo_h + tok64 * sdo_n)[:, None] + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0)
    l_off = b64 * sl_b + heads64 * sl_h + tok64
    lse2 = tl.load(LSE + l_off, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + l_off, mask=row_ok, other=0.0)
    k_ptr = K + b64 * sk_b + hk.to(tl.int64) * sk_h + k_start.to(tl.int64) * sk_n
    v_ptr = V + b64 * sv_b + hk.to(tl.int64) * sv_h + k_start.to(tl.int64) * sv_n
    rows_pos = pos + off
    dq = tl.zeros([BLOCK_M, HEAD_D], dtype=tl.float32)
    lo, full_lo, full_hi, hi = _kv_ranges(p0, n_k, off, window, BLOCK_P, BLOCK_N, CAUSAL, WINDOW)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_ptr, v_ptr, sk_n, sv_n, rows_pos, lo, full_lo, n_k,
                       qk_scale2, window, K_DESC, V_DESC, b, hk, k_start, BLOCK_N, HEAD_D, True, CAUSAL,
                       WINDOW, TMA, VARLEN)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_ptr, v_ptr, sk_n, sv_n, rows_pos, full_lo, full_hi, n_k,
                       qk_scale2, window, K_DESC, V_DESC, b, hk, k_start, BLOCK_N, HEAD_D, False, CAUSAL,
                       WINDOW, TMA, VARLEN)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_ptr, v_ptr, sk_n, sv_n, rows_pos, full_hi, hi, n_k,
                       qk_scale2, window, K_DESC, V_DESC, b, hk, k_start, BLOCK_N, HEAD_D, True, CAUSAL,
                       WINDOW, TMA, VARLEN)
    dq = dq * sm_scale
    dq_rows = DQ + b64 * sdq_b + heads64 * sdq_h + tok64 * sdq_n
    tl.store(dq_rows[:, None] + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])
