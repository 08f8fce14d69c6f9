"""Which backend computes a :func:`sink_attention` call: ``"triton"`` (ours) or ``"fa4"``.

``backend="auto"`` picks per call:

* ours wherever FA4 cannot run (no ``flash-attn-4``, a GPU other than SM90/SM100/SM110, fp32,
  the CPU interpreter, non-causal attention, a head_dim FA4 refuses) and for decoding (a few
  queries against a cache, where our kernel packs the GQA group into one tile);
* otherwise the faster of the two for the call's shape, from :data:`MEASURED`: FA4's time over ours,
  measured on an H200 by ``benchmarks/sink_attention_bench.py --table`` (bf16, 64 query and 8 KV
  heads, head_dim 64). A call is matched to the nearest measured window (in log2; "full" for
  no window or a window covering every key) and sequence length, using the forward+backward
  figure when autograd will need a backward and the forward figure otherwise.

``AGENTRL_SINK_BACKEND`` (``auto`` / ``triton`` / ``fa4``) sets the default of ``backend=None``.
"""

from __future__ import annotations

import math
import os

import torch

BACKENDS = ("auto", "triton", "fa4")

# FA4 time / Triton time (> 1: ours is faster), keyed by (window or None for full causal, tokens per
# sequence): (forward, forward+backward). H200, bf16, Hq=64, Hkv=8, D=64, B*N = 16384 tokens.
# Source: benchmarks/RESULTS.md, section "Sink attention: FA4 beside ours".
MEASURED: dict[tuple[int | None, int], tuple[float, float]] = {
    (None, 16384): (0.77, 0.70),
    (None, 4096): (0.79, 0.73),
    (128, 16384): (1.29, 1.21),
    (128, 4096): (1.28, 1.33),
}


def default_backend() -> str:
    name = os.environ.get("AGENTRL_SINK_BACKEND", "auto").strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"AGENTRL_SINK_BACKEND must be one of {BACKENDS}; got {name!r}")
    return name


def _nearest(window: int | None, n: int) -> tuple[float, float]:
    def dist(key):
        w, kn = key
        dw = 0.0 if w == window else (math.inf if (w is None) != (window is None) else
                                      abs(math.log2(w) - math.log2(window)))
        return dw, abs(math.log2(kn) - math.log2(max(n, 1)))

    return MEASURED[min(MEASURED, key=dist)]


def fa4_is_faster(window: int | None, n_k: int, needs_grad: bool) -> bool:
    """From the measured table: is FA4 faster than ours for this mask and length?"""
    if window is not None and window >= n_k:
        window = None  # the window covers every key: full causal attention
    fwd, fwdbwd = _nearest(window, n_k)
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
