"""Which backend computes a :func:`sink_attention` call: ``"triton"`` (ours) or ``"fa4"``.

``backend="auto"`` picks per call:

* ours wherever FA4 cannot run (no ``flash-attn-4``, a GPU other than SM90/SM100/SM110, fp32,
  the CPU interpreter, non-causal attention, a head_dim FA4 refuses) and for decoding (a few
  queries against a cache, where our kernel packs the GQA group into one tile);
* otherwise the faster of the two for the call's shape, from :data:`MEASURED`: FA4's time over ours,
  measured on an H200 by ``benchmarks/sink_attention_bench.py --table`` (bf16, 64 query and 8 KV
  heads, head_dim 64), read at the nearest measured length and interpolated in log2(window) (see
  :func:`measured_ratio`), using the forward+backward figure when autograd will need a backward
  and the forward figure otherwise. Today that is ours for windows up to about 300 keys, FA4
  for longer windows and full causal attention.

``AGENTRL_SINK_BACKEND`` (``auto`` / ``triton`` / ``fa4``) sets the default of ``backend=None``.
Under ``auto``, a kernel that fails to compile or launch hands its shape class to :func:`fallback`'s pick
(see :mod:`agentrl.kernels.fallback`).
"""

from __future__ import annotations

import math
import os

import torch

BACKENDS = ("auto", "triton", "fa4")

# FA4 time / Triton time (> 1: ours is faster), keyed by (window, or None for full causal; tokens
# per sequence): (forward, forward+backward). Measured 2026-12-01 on one H200 (bf16, Hq=64, Hkv=8,
# D=64; B=1 at N=16384 and B=4 at N=4096) by benchmarks/sink_attention_bench.py --table, our kernels
# at their tuned configs; see benchmarks/RESULTS.md, "Sink attention: FA4 beside ours".
MEASURED: dict[tuple[int | None, int], tuple[float, float]] = {
    (None, 16384): (0.85, 0.72),
    (128, 16384): (1.29, 1.33),
    (512, 16384): (0.92, 0.86),
    (2048, 16384): (0.71, 0.75),
    (None, 4096): (0.90, 0.73),
    (128, 4096): (1.30, 1.27),
    (512, 4096): (0.95, 0.87),
    (2048, 4096): (0.71, 0.74),
}


def default_backend() -> str:
    name = os.environ.get("AGENTRL_SINK_BACKEND", "auto").strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"AGENTRL_SINK_BACKEND must be one of {BACKENDS}; got {name!r}")
    return name


def measured_ratio(window: int | None, n_k: int) -> tuple[float, float]:
    """FA4/ours (forward, forward+backward) for a mask and length: the measured length nearest in
    log2, then linear in log2(window) between the measured windows, full attention counting as a
    window of ``n`` keys (and any window covering every key as full attention)."""
    lengths = sorted({n for _, n in MEASURED})
    n = min(lengths, key=lambda m: abs(math.log2(m) - math.log2(max(n_k, 1))))
    points = sorted((n if w is None else w, MEASURED[(w, n)]) for w, m in MEASURED if m == n)
    w = n if window is None or window >= n_k else window
    if w <= points[0][0]:
        return points[0][1]
    if w >= points[-1][0]:
        return points[-1][1]
    for (w0, r0), (w1, r1) in zip(points, points[1:], strict=False):
        if w0 <= w <= w1:
            t = (math.log2(w) - math.log2(w0)) / (math.log2(w1) - math.log2(w0))
            return tuple(a + t * (b - a) for a, b in zip(r0, r1, strict=True))
    return points[-1][1]  # pragma: no cover - the loop covers every w between the ends


def fa4_is_faster(window: int | None, n_k: int, needs_grad: bool) -> bool:
    """From the measured table: is FA4 faster than ours for this mask and length?"""
    fwd, fwdbwd = measured_ratio(window, n_k)
    return (fwdbwd if needs_grad else fwd) < 1.0


def choose(backend: str, *, q: torch.Tensor, head_dim: int, sinks, causal: bool, window: int | None,
           n_q: int, n_k: int, group: int, needs_grad: bool, interpreting: bool) -> str:
    """``"triton"`` or ``"fa4"`` for one call. ``backend="fa4"`` raises (saying why) when FA4 cannot
    run the call; ``"auto"`` falls back to ours silently."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    if backend == "triton":
        return "triton"
    from agentrl.kernels import _fa4

    reason = "the Triton interpreter is on (TRITON_INTERPRET=1)" if interpreting else \
        _fa4.unsupported_reason(q, head_dim, sinks, causal, window)
    if backend == "fa4":
        if reason is not None:
            raise RuntimeError(f"sink_attention(backend='fa4') cannot run this call: {reason}")
        return "fa4"
    if reason is not None or not causal:
        return "triton"
    if n_q * group <= 64:  # decoding: our GQA-packed tile wins (and FA4's bwd is pointless there)
        return "triton"
    return "fa4" if fa4_is_faster(window, n_k, needs_grad) else "triton"


def fallback(*, q: torch.Tensor, head_dim: int, sinks, causal: bool, window: int | None, interpreting: bool) -> str:
    """What ``auto`` takes when our kernel fails to compile or launch (see :mod:`agentrl.kernels.fallback`):
    ``"fa4"`` where FA4 can run the call, else ``"torch"`` (:mod:`agentrl.kernels._torch_sink`)."""
    if interpreting or not causal:
        return "torch"
    from agentrl.kernels import _fa4

    return "fa4" if _fa4.unsupported_reason(q, head_dim, sinks, causal, window) is None else "torch"
