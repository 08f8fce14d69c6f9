"""Masked reductions over ``[B, T]`` response-token matrices, and the dtype the algorithms compute in.

``mask`` is 1 (or True) for model tokens and 0 for env/pad tokens. Values outside the mask never reach a
result, whatever they are (``NaN`` and ``±inf`` included): every reduction selects with ``torch.where``
before it multiplies or adds. Means divide by ``count + 1e-8`` so an all-zero mask yields 0, not NaN.

Precision: every public algorithm function promotes its floating inputs with :func:`promote` first, so
fp16 and bf16 tensors (and integer rewards or masks) are accumulated in fp32, as verl's pipeline holds
them (its rewards, advantages and log-probs are fp32); fp64 stays fp64. Results come back in that dtype.
"""

from __future__ import annotations

import torch

_EPS = 1e-8


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """fp64 if a floating input is fp64, else fp32 (fp16, bf16, integer and bool inputs are promoted)."""
    dtype = torch.float32
    for t in tensors:
        if t is not None and t.is_floating_point():
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def promote(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """``tensors`` in their :func:`compute_dtype` (None stays None; gradients flow through the cast)."""
    dtype = compute_dtype(*tensors)
    return [None if t is None else t.to(dtype) for t in tensors]


def masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` where ``mask`` is nonzero, exactly 0 elsewhere (gradient 0 there, never NaN)."""
    return torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values * mask`` over the elements where ``mask`` is nonzero (all, or along ``dim``)."""
    kept = masked(values, mask) * mask
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is nonzero; 0 where the mask is empty."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / (count + _EPS)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(values - mean) / sqrt(var + 1e-8)`` with masked mean and unbiased masked variance (verl's rule).

    With fewer than two tokens in the mask the variance is undefined (verl raises); here every centred
    value is then 0, so the result is all zeros: no learning signal rather than a crash mid-run.
    Positions outside the mask hold ``(values - mean) / std`` of whatever they held (0 if non-finite).
    """
    n = mask.sum()
    if n < 2:
        return torch.zeros_like(values)
    values = torch.where(mask.bool() | torch.isfinite(values), values, torch.zeros_like(values))
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask) * (n / (n - 1))
    return (values - mean) * torch.rsqrt(var + _EPS)


def masked_max(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Maximum of ``values`` where ``mask`` is nonzero (``-inf`` where the mask is empty)."""
    filled = values.masked_fill(~mask.bool(), float("-inf"))
    return filled.max() if dim is None else filled.max(dim=dim).values


def masked_min(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Minimum of ``values`` where ``mask`` is nonzero (``+inf`` where the mask is empty)."""
    filled = values.masked_fill(~mask.bool(), float("inf"))
    return filled.min() if dim is None else filled.min(dim=dim).values
