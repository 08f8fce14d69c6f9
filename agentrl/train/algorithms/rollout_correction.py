"""Rollout correction: importance weights and rejection masks for the rollout-vs-training policy gap.

The rollout engine (e.g. vLLM in bf16, or a KV-cached ``generate``) and the training forward compute
slightly different probabilities for the same tokens. With ``rho = pi_train / pi_rollout`` per token:

* IS (``rollout_is``): ``"token"`` weights ``rho_t``; ``"sequence"`` weights ``prod_t rho_t`` broadcast to
  the row. ``rollout_is_threshold`` as a float truncates weights at that upper bound (TIS); as a
  ``"lo_hi"`` string (e.g. ``"0.5_2.0"``) zeroes weights outside ``[lo, hi]`` (IcePop-style masking).
* RS (``rollout_rs``): comma-separated rejection criteria on per-token divergences k1/k2/k3 of
  ``log rho`` -- ``token_k{1,2,3}``, ``seq_sum_k{1,2,3}``, ``seq_mean_k{1,2,3}``, ``seq_max_k{2,3}`` -- with
  ``rollout_rs_threshold`` (one value, or one per option, comma-separated; k1 options take ``"lo_hi"``
  ratio bounds, a single value ``u`` meaning ``[1/u, u]``). Rejected tokens are zeroed in the returned mask.

Our own implementation of verl 0.9.1's ``rollout_corr_helper.compute_rollout_correction_and_rejection_mask``
(same weights, masks and ``rollout_corr/*`` metrics; checked against verl in
``tests/test_algos_parity.py``). Beyond verl's metrics we add the raw gap metrics:

* ``rollout_corr/logprob_abs_diff_mean``: mean over model tokens of ``|log pi_train - log pi_rollout|``.
* ``rollout_corr/logprob_abs_diff_max``: its maximum.
The k3 KL estimate of the gap is verl's ``rollout_corr/k3_kl`` (``E[rho - log rho - 1]``), kept under
verl's name; ``rollout_corr/kl`` is the k1 estimate ``E[log pi_rollout - log pi_train]``.
"""

from __future__ import annotations

import math

import torch

from agentrl.train.algorithms._masked import masked_max, masked_mean, masked_min, masked_sum

SAFETY_BOUND = 20.0
RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)


def parse_is_threshold(spec: float | int | str) -> tuple[float, float | None]:
    """``2.0`` -> ``(2.0, None)`` (TIS); ``"0.5_2.0"`` -> ``(2.0, 0.5)`` (IcePop). Returns ``(upper, lower)``."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise TypeError(f"rollout_is_threshold must be a number or a 'lo_hi' string, got {spec!r}")
    lower = None
    try:
        if isinstance(spec, str) and "_" in spec:
            lo, hi = spec.strip().split("_", 1)
            lower, upper = float(lo), float(hi)
        else:
            upper = float(spec)
    except ValueError as exc:
        raise ValueError(
            f"rollout_is_threshold {spec!r} is not a number or a 'lo_hi' pair like '0.5_2.0'"
        ) from exc
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"rollout_is_threshold {spec!r} needs 0 < lo <= hi")
    return upper, lower


def parse_rs_thresholds(
    options: list[str], spec: float | int | str | None
) -> dict[str, tuple[float | None, float]]:
    """Per option ``(lower, upper)``; ``lower`` is set only for k1 options (ratio bounds)."""
    if spec is None:
        raise ValueError("rollout_rs_threshold is required when rollout_rs is set (e.g. 2.0 or '0.5_2.0')")
    parts = (
        [str(spec)]
        if isinstance(spec, (int, float))
        else [p.strip() for p in str(spec).split(",") if p.strip()]
    )
    if len(parts) == 1:
        parts = parts * len(options)
    if len(parts) != len(options):
        raise ValueError(
            f"rollout_rs_threshold has {len(parts)} values for {len(options)} rollout_rs options; "
            "give one shared value or one per option"
        )
    out: dict[str, tuple[float | None, float]] = {}
    for opt, part in zip(options, parts, strict=True):
        try:
            if opt.endswith("k1"):
                lo_s, hi_s = part.split("_", 1) if "_" in part else (None, part)
                hi = float(hi_s)
                lo = 1.0 / hi if lo_s is None else float(lo_s)
                if not 0 < lo <= hi:
                    raise ValueError
                out[opt] = (lo, hi)
            else:
                hi = float(part)
                if hi <= 0:
                    raise ValueError
                out[opt] = (None, hi)
        except ValueError as exc:
            raise ValueError(
                f"bad rollout_rs_threshold {part!r} for {opt!r}: k1 options take 'lo_hi' or one "
                "ratio bound u > 0 (meaning [1/u, u]); k2/k3 options take one positive upper bound"
            ) from exc
    return out


def _is_weights(log_ratio, mask, level, upper, lower, batch_normalize):
    """Return ``(weights, metrics)`` for IS; weights are detached and zero outside ``mask``."""
    if level == "token":
        log_for_metrics = log_ratio
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    elif level == "sequence":
        log_for_metrics = masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1)
        raw = torch.exp(log_for_metrics.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    else:
        raise ValueError(f"rollout_is must be 'token', 'sequence' or None, got {level!r}")
    raw = raw * mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))

    m: dict[str, float] = {}
    lo_bound = 1.0 / upper if lower is None else lower
    m["rollout_is_mean"] = masked_mean(weights, mask).item()
    if level == "sequence":
        m["rollout_is_max"] = math.exp(min(log_for_metrics.max().item(), SAFETY_BOUND))
        m["rollout_is_min"] = math.exp(log_for_metrics.min().item())
        m["rollout_is_ratio_fraction_high"] = (log_for_metrics > math.log(upper)).float().mean().item()
        m["rollout_is_ratio_fraction_low"] = (log_for_metrics < math.log(lo_bound)).float().mean().item()
    else:
        m["rollout_is_ratio_fraction_high"] = masked_mean((raw > upper).float(), mask).item()
        m["rollout_is_ratio_fraction_low"] = masked_mean((raw < lo_bound).float(), mask).item()
        m["rollout_is_max"] = masked_max(weights, mask).item()
        m["rollout_is_min"] = masked_min(weights, mask).item()
    bounded = weights.clamp(min=0.0, max=upper)
    bounded_mean = masked_mean(bounded, mask)
    if mask.sum() > 1:
        var = masked_mean(bounded.square(), mask) - bounded_mean.square()
        m["rollout_is_std"] = var.clamp(min=0.0).sqrt().item()
    else:
        m["rollout_is_std"] = 0.0
    m["rollout_is_eff_sample_size"] = (
        1.0 / masked_mean((bounded / (bounded_mean + 1e-8)).square(), mask).item()
    )
    seq_mean = masked_mean(weights, mask, dim=-1)
    m["rollout_is_seq_mean"] = seq_mean.mean().item()
    m["rollout_is_seq_std"] = seq_mean.std().item() if seq_mean.numel() > 1 else 0.0
    m["rollout_is_seq_max"] = seq_mean.max().item()
    m["rollout_is_seq_min"] = seq_mean.min().item()
    m["rollout_is_seq_max_deviation"] = (seq_mean - 1.0).abs().max().item()
    raw_seq_mean = masked_mean(raw, mask, dim=-1)
    m["rollout_is_seq_fraction_high"] = (raw_seq_mean > upper).float().mean().item()
    m["rollout_is_seq_fraction_low"] = (raw_seq_mean < lo_bound).float().mean().item()
    if lower is not None:
        m["rollout_is_oob_ratio"] = masked_mean(((raw < lower) | (raw > upper)).float(), mask).item()

    weights = weights.detach()
    if batch_normalize:
        if level == "token":
            mean = masked_mean(weights, mask)
        else:
            rows = (mask.sum(dim=-1) > 0).to(weights.dtype)
            mean = (masked_mean(weights, mask, dim=-1) * rows).sum() / rows.sum().clamp(min=1e-8)
        if mean > 1e-8:
            weights = weights / mean
            m["rollout_is_batch_norm_factor"] = mean.item()
        else:
            m["rollout_is_batch_norm_factor"] = 1.0
    return weights, m


def _rs_mask(log_ratio, mask, rs, rs_threshold):
    """Return ``(keep mask [B, T] in mask's dtype, metrics)`` for rejection sampling."""
    options: list[str] = []
    for opt in (o.strip() for o in rs.split(",") if o.strip()):
        if opt not in RS_OPTIONS:
            raise ValueError(f"unknown rollout_rs option {opt!r}; choose from {list(RS_OPTIONS)}")
        if opt not in options:
            options.append(opt)
    if not options:
        raise ValueError("rollout_rs is empty; give options like 'token_k3' or 'seq_mean_k1,token_k2'")
    bounds = parse_rs_thresholds(options, rs_threshold)
    lr = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    per_token = {"k1": -lr, "k2": 0.5 * lr.square(), "k3": torch.exp(lr) - 1.0 - lr}
    mask_b = mask.bool()
    valid_rows = mask.sum(dim=-1) > 0
    combined = torch.ones_like(log_ratio)
    m: dict[str, float] = {}
    for opt in options:
        kind = opt[-2:]
        lower, upper = bounds[opt]
        is_k1 = kind == "k1"
        hi = math.log(upper) if is_k1 else upper
        lo = math.log(lower) if is_k1 else 0.0
        stat_tok = per_token[kind]
        if opt.startswith("token"):
            seq_stat = None
            stat = stat_tok
            keep = stat <= hi
        else:
            if opt.startswith("seq_sum"):
                seq_stat = masked_sum(stat_tok, mask, dim=-1)
            elif opt.startswith("seq_mean"):
                seq_stat = masked_mean(stat_tok, mask, dim=-1)
            else:
                seq_stat = masked_max(stat_tok, mask, dim=-1)
                seq_stat = torch.where(torch.isinf(seq_stat), torch.zeros_like(seq_stat), seq_stat)
            keep_row = seq_stat <= hi
            if is_k1:
                keep_row = keep_row & (seq_stat >= lo)
            keep = keep_row.unsqueeze(-1).expand_as(mask_b)
            stat = seq_stat.unsqueeze(-1).expand_as(log_ratio)
        if is_k1 and seq_stat is None:
            keep = keep & (stat >= lo)

        p = f"rollout_rs_{opt}"
        rows = seq_stat if seq_stat is not None else masked_mean(stat, mask, dim=-1)
        rows = rows[valid_rows]
        m[f"{p}_mean"] = masked_mean(stat, mask).item()
        if seq_stat is not None:
            m[f"{p}_max"], m[f"{p}_min"] = rows.max().item(), rows.min().item()
            m[f"{p}_fraction_high"] = (rows > hi).float().mean().item()
            m[f"{p}_fraction_low"] = (rows < lo).float().mean().item() if is_k1 else 0.0
        else:
            m[f"{p}_max"], m[f"{p}_min"] = masked_max(stat, mask).item(), masked_min(stat, mask).item()
            m[f"{p}_fraction_high"] = masked_mean((stat > hi).float(), mask).item()
            m[f"{p}_fraction_low"] = masked_mean((stat < lo).float(), mask).item() if is_k1 else 0.0
        if mask.sum() > 1:
            bounded = stat.clamp(min=lo if is_k1 else 0.0, max=hi)
            var = masked_mean(bounded.square(), mask) - masked_mean(bounded, mask).square()
            m[f"{p}_std"] = var.clamp(min=0.0).sqrt().item()
        else:
            m[f"{p}_std"] = 0.0
        m[f"{p}_seq_mean"] = rows.mean().item()
        m[f"{p}_seq_std"] = rows.std().item() if rows.numel() > 1 else 0.0
        m[f"{p}_seq_max"] = rows.max().item()
        m[f"{p}_seq_min"] = rows.min().item()
        m[f"{p}_seq_max_deviation"] = rows.abs().max().item()
        m[f"{p}_seq_fraction_high"] = (rows > hi).float().mean().item()
        if is_k1:
            m[f"{p}_seq_fraction_low"] = (rows < lo).float().mean().item()

        keep_f = keep.to(log_ratio.dtype)
        combined = combined * keep_f
        m[f"{p}_masked_fraction"] = masked_mean(1 - keep_f, mask).item()
        row_kept = (keep | ~mask_b).all(dim=-1)
        m[f"{p}_seq_masked_fraction"] = (
            (~row_kept & valid_rows).float().sum() / valid_rows.float().sum()
        ).item()

    m["rollout_rs_masked_fraction"] = masked_mean(1 - combined, mask).item()
    rejected_any = (~((combined > 0.5) & mask_b) & mask_b).any(dim=-1)
    m["rollout_rs_seq_masked_fraction"] = rejected_any.float().mean().item()
    return (mask * combined).to(mask.dtype), m


def _gap_metrics(old_log_prob, rollout_log_prob, mask):
    """verl's off-policy diagnostics (PPL, KL, chi^2) plus our absolute log-prob gap."""
    m: dict[str, float] = {}
    train_row = masked_mean(old_log_prob, mask, dim=-1)
    roll_row = masked_mean(rollout_log_prob, mask, dim=-1)
    m["training_ppl"] = torch.exp(-train_row).mean().item()
    m["training_log_ppl"] = (-train_row).mean().item()
    log_ratio = old_log_prob - rollout_log_prob
    m["kl"] = masked_mean(-log_ratio, mask).item()
    m["k3_kl"] = masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask).item()
    m["rollout_ppl"] = torch.exp(-roll_row).mean().item()
    m["rollout_log_ppl"] = (-roll_row).mean().item()
    ppl_diff = roll_row - train_row
    m["log_ppl_diff"] = ppl_diff.mean().item()
    m["log_ppl_abs_diff"] = ppl_diff.abs().mean().item()
    m["log_ppl_diff_max"] = ppl_diff.max().item()
    m["log_ppl_diff_min"] = ppl_diff.min().item()
    m["ppl_ratio"] = torch.exp(ppl_diff).mean().item()
    rho = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    m["chi2_token"] = (masked_mean(rho.square(), mask) - 1.0).item()
    seq_log = masked_sum(log_ratio, mask, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    m["chi2_seq"] = (torch.exp(2.0 * seq_log).mean() - 1.0).item()
    abs_diff = log_ratio.abs()
    m["logprob_abs_diff_mean"] = masked_mean(abs_diff, mask).item()
    m["logprob_abs_diff_max"] = masked_max(abs_diff, mask).item()
    return m


def rollout_correction(
    *,
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str | None = None,
    rollout_is_threshold: float | str | None = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: float | str | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """IS weights, rejection-filtered mask and ``rollout_corr/*`` metrics for one batch.

    Args:
      old_log_prob: ``[B, T]`` log-probs of the sampled tokens under the training forward (pi_train).
      rollout_log_prob: ``[B, T]`` log-probs the rollout engine reported (pi_rollout).
      response_mask: ``[B, T]`` 1 = model token; must contain at least one 1.
    Returns ``(is_weights [B, T] detached or None, response_mask with rejected tokens zeroed (same dtype),
    metrics)``. With both ``rollout_is`` and ``rollout_rs`` None only the gap metrics are computed.
    """
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ValueError(
            f"old_log_prob {tuple(old_log_prob.shape)}, rollout_log_prob {tuple(rollout_log_prob.shape)} and "
            f"response_mask {tuple(response_mask.shape)} must share one [B, T] shape"
        )
    if not response_mask.any():
        raise ValueError("response_mask has no model tokens; rollout correction needs at least one")
    old_log_prob = old_log_prob.detach()
    rollout_log_prob = rollout_log_prob.detach()
    log_ratio = old_log_prob - rollout_log_prob
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        upper, lower = parse_is_threshold(rollout_is_threshold)
        weights, is_m = _is_weights(
            log_ratio, response_mask, rollout_is, upper, lower, rollout_is_batch_normalize
        )
        metrics.update(is_m)
    new_mask = response_mask.clone()
    if rollout_rs is not None:
        new_mask, rs_m = _rs_mask(log_ratio, response_mask, rollout_rs, rollout_rs_threshold)
        metrics.update(rs_m)
    metrics.update(_gap_metrics(old_log_prob, rollout_log_prob, response_mask))
    return weights, new_mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}
