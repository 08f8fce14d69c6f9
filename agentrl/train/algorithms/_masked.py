"""Masked reductions over ``[B, T]`` response-token matrices.

``mask`` is 1 (or True) for model tokens and 0 for env/pad tokens. Means divide by ``count + 1e-8`` so
an all-zero mask yields 0 rather than NaN; values outside the mask never contribute (NaN included).
"""

from __future__ import annotations

import torch

_EPS = 1e-8


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is nonzero (over all elements, or along ``dim``)."""
    kept = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    kept = kept * mask
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is nonzero; 0 where the mask is empty."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / (count + _EPS)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(values - mean) / sqrt(var + 1e-8)`` with masked mean and unbiased masked variance.

    Raises ValueError if fewer than two tokens are in the mask (the unbiased variance is undefined).
    """
    n = mask.sum()
    if n < 2:
        raise ValueError(
            f"whitening needs at least 2 unmasked tokens, got {int(n)}; use a larger batch or an estimator "
            "that does not whiten (e.g. 'grpo')"
        )
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
