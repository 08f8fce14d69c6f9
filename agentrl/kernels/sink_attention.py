"""Sink attention (GPT-OSS) with Triton forward and backward, as an autograd function.

Math: ``s_ij = scale * q_i . k_j``; ``L_i = log(sum_j exp(s_ij) + exp(sigma_h))``;
``O_i = sum_j exp(s_ij - L_i) v_j``. The sink ``sigma_h`` joins the normaliser but carries no value.
Its gradient is ``d sigma_h = -sum_{batch, i} p_i (dO_i . O_i - dL_i)`` with ``p_i = exp(sigma_h - L_i)``,
per query head.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from agentrl.kernels import _dispatch, fallback
from agentrl.kernels._torch_sink import TorchSinkFn, torch_sink_backward

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class KernelConfig:
    """Tile shape and launch parameters of one kernel (``num_stages`` is ignored by the interpreter).

    ``pack``: put the query heads of a GQA group into one tile's rows (``block_m // group``
    positions each), so that they share K/V tiles and one causal/window range; pays off for
    sliding windows and decoding. Ignored unless the group is a power of two up to ``block_m``.
    ``tma``: load tiles through tensor descriptors (TMA on Hopper) instead of pointers: K/V in the
    forward and dq kernels, q/dO in the dkdv kernel (one head per tile only), where dQ by atomics
    then also goes through a bulk tensor reduction (dense layouts). Ignored where descriptors
    cannot describe the tensors (unaligned strides).
    ``atomic_dq`` (dkdv): compute dQ inside the dK/dV kernel with fp32 atomics (one recomputation
    of P instead of two; dQ then depends on the order of the atomic adds, d sink does not).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    pack: bool = False
    tma: bool = False
    atomic_dq: bool = False


# Benchmarks and tests may override the heuristic per kernel ("fwd", "dkdv", "dq"), per kernel and
# case ("fwd/full", "dkdv/window", "dq/decode") or per kernel, case and head_dim ("fwd/full/d64");
# the most specific key wins, None means the heuristic. ``$AGENTRL_SINK_CONFIGS`` names a JSON file
# of such overrides (see :func:`load_config_overrides`), read when this module is imported.
CONFIG_OVERRIDES: dict[str, KernelConfig | None] = {"fwd": None, "dkdv": None, "dq": None}


def load_config_overrides(path: str) -> dict[str, KernelConfig]:
    """Read ``{"fwd/full/d64": [block_m, block_n, num_warps, num_stages, pack, tma, atomic_dq], ...}``
    (trailing fields optional) from a JSON file, e.g. written by ``benchmarks/sink_attention_bench.py
    --sweep-out``, into :data:`CONFIG_OVERRIDES`; returns what was loaded."""
    import json

    with open(path) as f:
        raw = json.load(f)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object of kernel configs, got {type(raw).__name__}")
    loaded = {}
    for key, fields in raw.items():
        if key.split("/")[0] not in ("fwd", "dkdv", "dq") or not isinstance(fields, list) or not 4 <= len(fields) <= 7:
            raise ValueError(f"{path}: bad entry {key!r}: {fields!r}; keys start with fwd/dkdv/dq and values "
                             "are [block_m, block_n, num_warps, num_stages, pack?, tma?, atomic_dq?]")
        loaded[key] = KernelConfig(*fields)
    CONFIG_OVERRIDES.update(loaded)
    return loaded


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _kernels():
    try:
        from agentrl.kernels import _triton_sink
    except ImportError as exc:  # pragma: no cover - exercised only without triton
        raise fallback.KernelSetupError(
            "agentrl.kernels.sink_attention needs Triton (pip install 'agentrl-sdk[kernels]'); "
            f"importing it failed: {exc}"
        ) from exc
    if _interpreting():
        import triton.language.standard as std

        if type(std.sum).__name__ != "InterpretedFunction":
            raise fallback.KernelSetupError(
                "TRITON_INTERPRET=1 was set after triton had been imported (triton's own functions are "
                "compiled, not interpreted); set it in the environment before the process imports triton")
    return _triton_sink


def _pick(kind: str, head_dim: int, max_q: int, group: int, window: int | None) -> KernelConfig:
    """Tile configuration per kernel; the GPU choices come from sweeps on an H200 (see
    benchmarks/RESULTS.md)."""
    decode = max_q * group <= 64
    case = "decode" if decode else "window" if window is not None else "full"
    for key in (f"{kind}/{case}/d{head_dim}", f"{kind}/{case}", kind):
        if CONFIG_OVERRIDES.get(key) is not None:
            return CONFIG_OVERRIDES[key]
    pack = group > 1 and (window is not None or decode)
    if _interpreting():
        return KernelConfig(16, 16, 4, 1, pack)
    wide = head_dim > 64
    tma = head_dim == 64  # the TMA variants were measured (and GPU-tested at every shape class) at D=64
    if decode:
        return KernelConfig(max(16, triton_next_pow2(max_q * group if pack else max_q)), 64, 4, 2, pack)
    if kind == "fwd":
        if window is not None:
            return KernelConfig(64, 32, 4, 3, pack)
        return KernelConfig(128, 64, 8, 3) if wide else KernelConfig(128, 128, 4, 3, tma=tma)
    if kind == "dq":
        if window is not None:
            return KernelConfig(64, 32, 4, 3, pack)
        if wide:
            return KernelConfig(64, 64, 8, 3)
        return KernelConfig(64, 128, 4, 3, tma=True) if tma else KernelConfig(64, 64, 4, 3)
    # dkdv: the query-block loop is the inner loop. (dQ by atomics inside it was slower on the H200:
    # 20.2 ms per element, 16.0 ms by bulk reduction, against 15.3 ms for the two kernels.)
    if window is not None:
        return KernelConfig(64, 64, 4, 3, pack)
    if wide:
        return KernelConfig(64, 64, 8, 3)
    return KernelConfig(64, 64, 4, 4, tma=True) if tma else KernelConfig(64, 64, 4, 3)


if os.environ.get("AGENTRL_SINK_CONFIGS"):
    load_config_overrides(os.environ["AGENTRL_SINK_CONFIGS"])


def _pack(cfg: KernelConfig, group: int) -> int:
    """Heads per tile: the whole group when packing applies (a power of two not above block_m, so
    that every tile row maps to a head of the same group), else 1."""
    usable = 1 < group <= cfg.block_m and group & (group - 1) == 0
    return group if cfg.pack and usable else 1


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@dataclass(frozen=True)
class _Layout:
    """Dense ([B, H, N, D]) or packed ([total, H, D] + cu_seqlens) geometry of one call."""

    varlen: bool
    batch: int
    n_q: int  # dense length, or max_seqlen_q for packed
    n_k: int
    hq: int
    hkv: int
    head_dim: int

    def strides(self, t: torch.Tensor) -> tuple[int, int, int]:
        """(batch, head, token) strides of a q/k/v-like tensor in elements."""
        if self.varlen:
            return 0, t.stride(1), t.stride(0)
        return t.stride(0), t.stride(1), t.stride(2)

    def lse_shape(self, total_q: int) -> tuple[int, ...]:
        return (self.hq, total_q) if self.varlen else (self.batch, self.hq, self.n_q)

    def lse_strides(self, lse: torch.Tensor) -> tuple[int, int]:
        return (0, lse.stride(0)) if self.varlen else (lse.stride(0), lse.stride(1))


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _descriptors(tensors, lay: _Layout, block_rows: int):
    """Tensor descriptors for TMA tiles of ``block_rows`` tokens of one head (block
    ``[1, 1, block_rows, D]`` over dense ``[B, H, N, D]``, ``[block_rows, 1, D]`` over packed
    ``[total, H, D]``), or ``None`` when TMA cannot address one of them (16-byte aligned base and
    strides needed)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    descs = []
    for t in tensors:
        if t.data_ptr() % 16 or any((st * t.element_size()) % 16 for st in t.stride()[:-1]) or t.numel() == 0:
            return None
        block = [block_rows, 1, lay.head_dim] if lay.varlen else [1, 1, block_rows, lay.head_dim]
        descs.append(TensorDescriptor(t, list(t.shape), list(t.stride()), block))
    return descs


def _launch_fwd(q, k, v, sinks, cu_q, cu_k, lay: _Layout, causal, window, scale):
    kern = _kernels()
    out = torch.empty_like(q)
    total_q = q.shape[0]
    lse = torch.empty(lay.lse_shape(total_q), device=q.device, dtype=torch.float32)
    group = lay.hq // lay.hkv
    cfg = _pick("fwd", lay.head_dim, lay.n_q, group, window)
    pack = _pack(cfg, group)
    k_desc = v_desc = None
    if cfg.tma:
        k_desc, v_desc = _descriptors((k, v), lay, cfg.block_n) or (None, None)
    grid = (triton_cdiv(lay.n_q, cfg.block_m // pack), lay.batch * lay.hq // pack)
    dummy = lse  # any tensor: pointer arguments behind a false constexpr are never read
    kern.sink_fwd_kernel[grid](
        q, k, v, sinks if sinks is not None else dummy, out, lse,
        cu_q if cu_q is not None else dummy, cu_k if cu_k is not None else dummy, k_desc, v_desc,
        *lay.strides(q), *lay.strides(k), *lay.strides(v), *lay.strides(out), *lay.lse_strides(lse),
        lay.n_q, lay.n_k, lay.hq, lay.hq // lay.hkv, scale * kern.LOG2E, window or 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_D=lay.head_dim, CAUSAL=causal,
        WINDOW=window is not None, VARLEN=lay.varlen, HAS_SINK=sinks is not None, PACK=pack,
        TMA=k_desc is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse


def _launch_bwd(do, q, k, v, sinks, out, lse, dlse, cu_q, cu_k, lay: _Layout, causal, window, scale):
    kern = _kernels()
    do = _last_dim_contiguous(do)
    delta = torch.empty_like(lse)
    sinkterm = torch.empty_like(lse) if sinks is not None else None
    dummy = lse
    cu_q_arg = cu_q if cu_q is not None else dummy
    cu_k_arg = cu_k if cu_k is not None else dummy
    pre_m = 64 if not _interpreting() else 16
    kern.sink_bwd_preprocess_kernel[(triton_cdiv(lay.n_q, pre_m), lay.batch * lay.hq)](
        out, do, lse, dlse if dlse is not None else dummy, sinks if sinks is not None else dummy,
        delta, sinkterm if sinkterm is not None else dummy, cu_q_arg, cu_k_arg,
        *lay.strides(out), *lay.strides(do), *lay.lse_strides(lse), lay.n_q, lay.n_k, lay.hq,
        BLOCK_M=pre_m, HEAD_D=lay.head_dim, VARLEN=lay.varlen, HAS_DLSE=dlse is not None,
        HAS_SINK=sinks is not None,
    )
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    group = lay.hq // lay.hkv
    common = dict(HEAD_D=lay.head_dim, CAUSAL=causal, WINDOW=window is not None, VARLEN=lay.varlen)
    cfg = _pick("dkdv", lay.head_dim, lay.n_q, group, window)
    pack = _pack(cfg, group)
    # atomic dQ: an fp32 buffer (zeroed) that the dK/dV kernel adds into; else a separate dQ kernel
    dq = torch.zeros_like(q, dtype=torch.float32) if cfg.atomic_dq else torch.empty_like(q)
    descs = _descriptors((q, do, dq), lay, cfg.block_m) if cfg.tma and pack == 1 else None
    q_desc, do_desc, dq_desc = descs or (None, None, None)
    # the bulk reduction (TMA) of dQ: dense layouts on a GPU (the interpreter has no reductions)
    dq_tma = descs is not None and cfg.atomic_dq and not lay.varlen and not _interpreting()
    kern.sink_bwd_dkdv_kernel[(triton_cdiv(lay.n_k, cfg.block_n), lay.batch * lay.hkv)](
        q, k, v, do, lse, delta, dk, dv, dq, cu_q_arg, cu_k_arg, q_desc, do_desc, dq_desc if dq_tma else None,
        *lay.strides(q), *lay.strides(k), *lay.strides(v), *lay.strides(do), *lay.strides(dk),
        *lay.strides(dv), *lay.strides(dq), *lay.lse_strides(lse), lay.n_q, lay.n_k, lay.hkv, group,
        scale * kern.LOG2E, scale, window or 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        PACK=pack, ATOMIC_DQ=cfg.atomic_dq, TMA=descs is not None, DQ_TMA=dq_tma, **common,
    )
    if cfg.atomic_dq:
        dq = dq.to(q.dtype)
    else:
        cfg = _pick("dq", lay.head_dim, lay.n_q, group, window)
        pack = _pack(cfg, group)
        kv_descs = _descriptors((k, v), lay, cfg.block_n) if cfg.tma else None
        kern.sink_bwd_dq_kernel[(triton_cdiv(lay.n_q, cfg.block_m // pack), lay.batch * lay.hq // pack)](
            q, k, v, do, lse, delta, dq, cu_q_arg, cu_k_arg, *(kv_descs or (None, None)),
            *lay.strides(q), *lay.strides(k), *lay.strides(v), *lay.strides(do), *lay.strides(dq),
            *lay.lse_strides(lse), lay.n_q, lay.n_k, lay.hq, group, scale * kern.LOG2E, scale, window or 0,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            PACK=pack, TMA=kv_descs is not None, **common,
        )
    dsink = None
    if sinks is not None:
        reduce_dims = (1,) if lay.varlen else (0, 2)
        dsink = -sinkterm.sum(dim=reduce_dims)  # fixed-order reduction: deterministic
    return dq, dk, dv, dsink


def triton_cdiv(a: int, b: int) -> int:
    return max(1, -(-int(a) // int(b)))


class _SinkAttentionFn(torch.autograd.Function):
    """Our kernels. ``shape_class``: under ``backend="auto"``, the call's :func:`_shape_class` (a backward
    that fails to compile or launch then recomputes the gradients in torch, see
    :mod:`agentrl.kernels.fallback`); None for ``backend="triton"`` (failures raise)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_q, cu_k, lay, causal, window, scale, shape_class):
        sinks32 = sinks.detach().float().contiguous() if sinks is not None else None
        out, lse = _launch_fwd(q, k, v, sinks32, cu_q, cu_k, lay, causal, window, scale)
        ctx.save_for_backward(q, k, v, sinks32, out, lse, cu_q, cu_k)
        ctx.meta = (lay, causal, window, scale, None if sinks is None else sinks.dtype, shape_class)
        ctx.set_materialize_grads(False)  # an unused LSE gives dlse=None, not a tensor of zeros
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, sinks32, out, lse, cu_q, cu_k = ctx.saved_tensors
        lay, causal, window, scale, sink_dtype, shape_class = ctx.meta
        if dout is None:
            dout = torch.zeros_like(out)
        dlse = dlse.contiguous() if dlse is not None else None
        args = (dout, q, k, v, sinks32, out, lse, dlse, cu_q, cu_k, lay, causal, window, scale)
        grads = None
        if shape_class is None:
            grads = _launch_bwd(*args)
        elif not fallback.failed(_BWD, shape_class):
            try:
                grads = _launch_bwd(*args)
            except Exception as exc:
                if not fallback.is_compile_failure(exc):
                    raise
                fallback.fall_back(_BWD, shape_class, exc, _TORCH)
        if grads is None:
            grads = torch_sink_backward(dout, dlse, q, k, v, sinks32, cu_q, cu_k, lay, causal, window, scale)
        dq, dk, dv, dsink = grads
        if dsink is not None:
            dsink = dsink.to(sink_dtype)
        return dq, dk, dv, dsink, None, None, None, None, None, None, None


_FWD, _BWD, _FA4 = "sink attention Triton forward", "sink attention Triton backward", "sink attention FA4"
_TORCH = "the torch fallback (agentrl.kernels._torch_sink)"


def _shape_class(q, k, v, sinks, lay: _Layout, causal: bool, window: int | None) -> tuple:
    """What selects a compiled variant of our kernels: dtype, device, head geometry, mask and layout flags,
    the tile case of :func:`_pick`, and which lengths and strides are multiples of 16 (Triton specialises
    integer arguments on that)."""
    case = "decode" if lay.n_q * (lay.hq // lay.hkv) <= 64 else "window" if window is not None else "full"
    div16 = tuple(int(x) % 16 == 0 for x in (lay.n_q, lay.n_k, *q.stride(), *k.stride(), *v.stride()))
    return (str(q.dtype), q.device.type, lay.head_dim, lay.hq, lay.hkv, causal, window is not None, lay.varlen,
            sinks is not None, case, div16)


def _guarded(kernel: str, shape_class: tuple, next_backend: str, call):
    """``call()``, or None when ``kernel`` failed (now or before) for ``shape_class`` to compile or launch."""
    if fallback.failed(kernel, shape_class):
        return None
    try:
        return call()
    except Exception as exc:
        if not fallback.is_compile_failure(exc):
            raise
        fallback.fall_back(kernel, shape_class, exc, next_backend)
        return None


def _check_cu(name: str, cu: torch.Tensor, total: int, device) -> torch.Tensor:
    if cu.dim() != 1 or cu.numel() < 2 or cu.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be a 1-D int32/int64 tensor [batch+1] of offsets; got "
                         f"shape {tuple(cu.shape)} dtype {cu.dtype}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but the tensors are on {device}; move it there")
    return cu.to(torch.int32).contiguous()


def _check_inputs(q: Any, k: Any, v: Any, sinks: Any, *, causal: bool, window: int | None,
                  packed: bool) -> tuple[int, int, int, int | None]:
    """Check :func:`sink_attention`'s tensors and window; returns ``(head_dim, Hq, Hkv, window)``."""
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
        raise TypeError("q, k and v must be torch tensors")
    if q.dtype not in _SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype among fp16/bf16/fp32; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.is_cuda or _interpreting()):
        raise RuntimeError("sink_attention runs on CUDA tensors (or on the CPU under TRITON_INTERPRET=1, "
                           "for tests); use sink_attention_reference for CPU tensors otherwise")
    if window is not None:
        if not causal:
            raise ValueError("window needs causal=True (a sliding window here is causal by definition)")
        if int(window) < 1:
            raise ValueError(f"window must be a positive number of keys; got {window}")
        window = int(window)
    want_dims = 3 if packed else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != want_dims:
            layout = "[total, H, D] with cu_seqlens" if packed else "[B, H, N, D]"
            raise ValueError(f"{name} must be {layout}; got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    head_dim = q.shape[-1]
    if k.shape[-1] != head_dim or head_dim not in (16, 32, 64, 128, 256):
        raise ValueError(f"head_dim must be one of 16, 32, 64, 128, 256 and equal for q and k; got "
                         f"{head_dim} and {k.shape[-1]}")
    hq, hkv = q.shape[-2 if packed else 1], k.shape[-2 if packed else 1]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"the number of KV heads ({hkv}) must divide the number of query heads ({hq})")
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != hq):
        raise ValueError(f"sinks must have shape [{hq}] (one logit per query head); got {tuple(sinks.shape)}")
    devices = {t.device for t in (q, k, v) + ((sinks,) if sinks is not None else ())}
    if len(devices) != 1:
        raise ValueError(f"q, k, v and sinks must be on one device; got {sorted(map(str, devices))}")
    return head_dim, hq, hkv, window


def _layout(q: torch.Tensor, k: torch.Tensor, heads: tuple[int, int, int], *, causal: bool, cu_seqlens: Any,
            cu_seqlens_k: Any, max_seqlen: int | None, max_seqlen_k: int | None) -> tuple[_Layout, Any, Any]:
    """The call's :class:`_Layout` and checked ``(cu_q, cu_k)`` (None for the dense layout); ``heads`` is
    ``(Hq, Hkv, head_dim)``."""
    if cu_seqlens is not None:
        cu_q = _check_cu("cu_seqlens", cu_seqlens, q.shape[0], q.device)
        cu_k = cu_q if cu_seqlens_k is None else _check_cu("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device)
        if cu_k.numel() != cu_q.numel():
            raise ValueError("cu_seqlens and cu_seqlens_k must describe the same number of sequences")
        if max_seqlen is None:
            max_seqlen = int((cu_q[1:] - cu_q[:-1]).max())
        if max_seqlen_k is None:
            max_seqlen_k = max_seqlen if cu_seqlens_k is None else int((cu_k[1:] - cu_k[:-1]).max())
        return _Layout(True, cu_q.numel() - 1, int(max_seqlen), int(max_seqlen_k), *heads), cu_q, cu_k
    if cu_seqlens_k is not None:
        raise ValueError("cu_seqlens_k needs cu_seqlens (packed layout)")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k batch sizes differ: {q.shape[0]} vs {k.shape[0]}")
    if causal and q.shape[2] > k.shape[2]:
        raise ValueError(f"causal attention needs Nq <= Nk (queries are the last Nq positions); got "
                         f"Nq={q.shape[2]}, Nk={k.shape[2]}")
    return _Layout(False, q.shape[0], q.shape[2], k.shape[2], *heads), None, None


def sink_attention(
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
    backend: str | None = None,
):
    """Attention with a per-head sink logit, differentiable in q, k, v and sinks.

    Args:
        q: dense ``[B, Hq, Nq, D]`` or packed ``[total_q, Hq, D]`` (with ``cu_seqlens``); fp16,
            bf16 or fp32 (fp32 dots run as TF32 on GPUs). ``D`` a power of two in 16..256.
        k, v: dense ``[B, Hkv, Nk, D]`` or packed ``[total_k, Hkv, D]``, same dtype; ``Hkv``
            divides ``Hq`` (query head ``h`` reads KV head ``h // (Hq // Hkv)``).
        sinks: ``[Hq]`` sink logits (any float dtype; used in fp32, added unscaled), or ``None``
            for plain attention.
        causal: causal masking. With ``Nq < Nk`` the queries are the last ``Nq`` positions
            (bottom-right alignment, as for decoding against a KV cache).
        window: sliding window of ``window`` keys including the query itself (FlashAttention's
            ``window_size=(window-1, 0)``); needs ``causal=True``.
        cu_seqlens: ``[S+1]`` int32/int64 offsets of ``S`` packed sequences in ``q`` (and in
            ``k``/``v`` unless ``cu_seqlens_k`` is given). Empty sequences are allowed.
        max_seqlen, max_seqlen_k: longest sequence (queries / keys), at least the true maximum
            (a smaller value leaves rows uncomputed); computed (one host sync) when omitted.
        return_lse: also return the log-sum-exp ``L`` (natural log, sink included), fp32,
            ``[B, Hq, Nq]`` dense or ``[Hq, total_q]`` packed; it is differentiable too.
        softmax_scale: score scale, default ``1/sqrt(D)``.
        backend: ``"auto"`` (default, or ``$AGENTRL_SINK_BACKEND``), ``"triton"`` (our kernels)
            or ``"fa4"`` (FlashAttention-4, ``pip install 'agentrl-sdk[fa4]'``; fp16/bf16 on
            SM90/SM100). ``auto`` takes FA4 where it is installed, can run the call and was
            measured faster (full causal attention on Hopper), ours otherwise (sliding windows,
            decoding, fp32, other GPUs, the CPU interpreter); see ``agentrl.kernels._dispatch``.
            Every backend computes the same function, gradients and LSE included. Under ``auto``, a
            kernel that fails to compile or launch (forward or backward) for a shape class never ends
            the run: the next backend (FA4 where it can run the call, else torch ops) computes it, with
            one warning per kernel and shape class (see :mod:`agentrl.kernels.fallback`); a named
            backend raises instead.

    Returns:
        ``out`` shaped like ``q`` (our kernels also keep ``q``'s strides; FA4's dense output is
        a ``[B, N, H, D]`` tensor seen as ``[B, H, N, D]``), or ``(out, lse)`` with ``return_lse``.
        A query row that sees no key returns ``out = 0`` and ``L = sigma``.
    """
    packed = cu_seqlens is not None
    head_dim, hq, hkv, window = _check_inputs(q, k, v, sinks, causal=causal, window=window, packed=packed)
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    lay, cu_q, cu_k = _layout(q, k, (hq, hkv, head_dim), causal=causal, cu_seqlens=cu_seqlens,
                              cu_seqlens_k=cu_seqlens_k, max_seqlen=max_seqlen, max_seqlen_k=max_seqlen_k)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, sinks))
    requested = _dispatch.default_backend() if backend is None else backend
    chosen = _dispatch.choose(
        requested, q=q, head_dim=head_dim, sinks=sinks, causal=bool(causal), window=window, n_q=lay.n_q,
        n_k=lay.n_k, group=hq // hkv, needs_grad=needs_grad, interpreting=_interpreting())
    args = (q, k, v, sinks, cu_q, cu_k, lay, bool(causal), window, scale)
    if requested != "auto":  # an explicit backend: its failures raise
        out, lse = _fa4_call(args, packed, return_lse) if chosen == "fa4" else _SinkAttentionFn.apply(*args, None)
        return (out, lse) if return_lse else out
    # auto: a kernel that fails to compile or launch hands the call (and its shape class) to the next backend
    shape_class = _shape_class(q, k, v, sinks, lay, bool(causal), window)
    result = None
    if chosen == "triton":
        nxt = _dispatch.fallback(q=q, head_dim=head_dim, sinks=sinks, causal=bool(causal), window=window,
                                 interpreting=_interpreting())
        result = _guarded(_FWD, shape_class, "FA4" if nxt == "fa4" else _TORCH,
                          lambda: _SinkAttentionFn.apply(*args, shape_class))
        chosen = nxt
    if result is None and chosen == "fa4":
        result = _guarded(_FA4, shape_class, _TORCH, lambda: _fa4_call(args, packed, return_lse))
    out, lse = result if result is not None else TorchSinkFn.apply(*args)
    return (out, lse) if return_lse else out


def _fa4_call(args, packed: bool, want_lse: bool):
    from agentrl.kernels._fa4 import fa4_sink_attention

    q, k, v, sinks, cu_q, cu_k, lay, causal, window, scale = args
    return fa4_sink_attention(q, k, v, sinks, causal=causal, window=window, scale=scale, cu_q=cu_q, cu_k=cu_k,
                              max_q=lay.n_q if packed else None, max_k=lay.n_k if packed else None,
                              want_lse=want_lse)
