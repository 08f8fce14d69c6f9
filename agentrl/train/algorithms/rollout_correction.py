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

from agentrl.train.algorithms._masked import masked, masked_max, masked_mean, masked_min, masked_sum, promote

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
    # written as "not within" so that NaN fails too
    if not (0 < upper < math.inf) or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"rollout_is_threshold {spec!r} must be a finite number > 0, or 'lo_hi' with 0 < lo <= hi")
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
                if not 0 < lo <= hi < math.inf:
                    raise ValueError
                out[opt] = (lo, hi)
            else:
                hi = float(part)
                if not 0 < hi < math.inf:
                    raise ValueError
                out[opt] = (None, hi)
        except ValueError as exc:
            raise ValueError(
                f"bad rollout_rs_threshold {part!r} for {opt!r}: k1 options take 'lo_hi' or one "
                "ratio bound u > 0 (meaning [1/u, u]); k2/k3 options take one positive upper bound (finite)"
            ) from exc
    return out


def _is_weights(log_ratio, mask, level, upper, lower):
    """Raw (unclipped) and applied IS weights ``[B, T]`` (zero outside ``mask``), and the log ratio the
    metrics use (per token, or per row ``[B, 1]``)."""
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
    return raw, weights, log_for_metrics


def _is_metrics(raw, weights, log_for_metrics, mask, level, upper, lower) -> dict[str, float]:
    """verl's ``compute_is_metrics`` (same names and values; ``inf`` where verl's saturate to ``inf``)."""
    m: dict[str, float] = {}
    lo_bound = 1.0 / upper if lower is None else lower
    m["rollout_is_mean"] = masked_mean(weights, mask).item()
    if level == "sequence":
        log_hi = torch.log(torch.tensor(upper, device=raw.device))
        log_lo = torch.log(torch.tensor(lo_bound, device=raw.device))
        m["rollout_is_max"] = torch.exp(log_for_metrics.max().clamp(max=SAFETY_BOUND)).item()
        m["rollout_is_min"] = torch.exp(log_for_metrics.min()).item()  # inf when every row's gap is huge
        m["rollout_is_ratio_fraction_high"] = (log_for_metrics > log_hi).float().mean().item()
        m["rollout_is_ratio_fraction_low"] = (log_for_metrics < log_lo).float().mean().item()
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
    # verl divides 1.0 by a Python float here and raises ZeroDivisionError when every weight is 0 (e.g.
    # IcePop rejected all tokens); no weight carries any sample then, so the effective sample size is 0
    spread = masked_mean((bounded / (bounded_mean + 1e-8)).square(), mask).item()
    m["rollout_is_eff_sample_size"] = 1.0 / spread if spread > 0 else 0.0
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
    return m


def _batch_normalize(weights, mask, level, with_metrics) -> tuple[torch.Tensor, dict[str, float]]:
    """Divide the weights by their batch mean (per token, or per row for ``sequence``) when it is > 1e-8."""
    if level == "token":
        mean = masked_mean(weights, mask)
    else:
        rows = (mask.sum(dim=-1) > 0).to(weights.dtype)
        mean = (masked_mean(weights, mask, dim=-1) * rows).sum() / rows.sum().clamp(min=1e-8)
    if mean > 1e-8:
        return weights / mean, ({"rollout_is_batch_norm_factor": mean.item()} if with_metrics else {})
    return weights, ({"rollout_is_batch_norm_factor": 1.0} if with_metrics else {})


def rs_options(rs: str) -> list[str]:
    """The distinct options of a ``rollout_rs`` string, in order; raises ``ValueError`` for an unknown or no option."""
    options: list[str] = []
    for opt in (o.strip() for o in rs.split(",") if o.strip()):
        if opt not in RS_OPTIONS:
            raise ValueError(f"unknown rollout_rs option {opt!r}; choose from {list(RS_OPTIONS)}")
        if opt not in options:
            options.append(opt)
    if not options:
        raise ValueError("rollout_rs is empty; give options like 'token_k3' or 'seq_mean_k1,token_k2'")
    return options


def _rs_mask(log_ratio, mask, rs, rs_threshold, with_metrics):
    """Return ``(keep mask [B, T] in mask's dtype, metrics)`` for rejection sampling."""
    options = rs_options(rs)
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
            if is_k1:
                keep = keep & (stat >= lo)
        else:
            if opt.startswith("seq_sum"):
                seq_stat = masked_sum(stat_tok, mask, dim=-1)
            elif opt.startswith("seq_mean"):
                seq_stat = masked_mean(stat_tok, mask, dim=-1)
            else:  # seq_max: rows without tokens get 0, as in verl
                seq_stat = masked_max(stat_tok, mask, dim=-1)
                seq_stat = torch.where(seq_stat == float("-inf"), torch.zeros_like(seq_stat), seq_stat)
            keep_row = seq_stat <= hi
            if is_k1:
                keep_row = keep_row & (seq_stat >= lo)
            keep = keep_row.unsqueeze(-1).expand_as(mask_b)
            stat = seq_stat.unsqueeze(-1).expand_as(log_ratio)
        keep_f = keep.to(log_ratio.dtype)
        combined = combined * keep_f
        if with_metrics:
            m.update(_rs_option_metrics(f"rollout_rs_{opt}", stat, seq_stat, keep, keep_f, mask, valid_rows,
                                        hi, lo, is_k1))
    if with_metrics:
        m["rollout_rs_masked_fraction"] = masked_mean(1 - combined, mask).item()
        rejected_any = (~((combined > 0.5) & mask_b) & mask_b).any(dim=-1)
        m["rollout_rs_seq_masked_fraction"] = rejected_any.float().mean().item()
    return (mask * combined).to(mask.dtype), m


def _rs_option_metrics(p, stat, seq_stat, keep, keep_f, mask, valid_rows, hi, lo, is_k1) -> dict[str, float]:
    """verl's ``compute_rs_metrics`` plus the option's masked fractions, for one rejection option."""
    m: dict[str, float] = {}
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
    m[f"{p}_masked_fraction"] = masked_mean(1 - keep_f, mask).item()
    row_kept = (keep | ~mask.bool()).all(dim=-1)
    m[f"{p}_seq_masked_fraction"] = ((~row_kept & valid_rows).float().sum() / valid_rows.float().sum()).item()
    return m


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
    with_metrics: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """IS weights, rejection-filtered mask and ``rollout_corr/*`` metrics for one batch.

    Truncated IS (TIS): Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
    Training", https://fengyao.notion.site/off-policy-rl. Masking outside ``[lo, hi]`` (IcePop): Ling Team
    2025, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking Model",
    https://arxiv.org/abs/2510.18855. Sequence-level IS and rejection by divergence: Liu et al. 2025, "When
    Speed Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch",
    https://richardli.xyz/rl-collapse (the references verl's ``rollout_corr_helper`` gives).

    Args:
      old_log_prob: ``[B, T]`` log-probs of the sampled tokens under the training forward (pi_train).
      rollout_log_prob: ``[B, T]`` log-probs the rollout engine reported (pi_rollout).
      response_mask: ``[B, T]`` 1 = model token; must contain at least one 1.
      rollout_is: ``"token"``, ``"sequence"`` or None (no weights).
      rollout_is_threshold: upper truncation bound (float) or ``"lo_hi"`` mask bounds (see the module).
      rollout_is_batch_normalize: divide the weights by their batch mean.
      rollout_rs: comma-separated rejection options (:data:`RS_OPTIONS`) or None;
        rollout_rs_threshold: their bounds.
      with_metrics: False skips every metric (no host syncs): for per-micro-batch weights and masks, whose
        metrics are then computed once over the whole batch.

    Returns:
      ``(is_weights [B, T] detached or None, response_mask [B, T] with rejected tokens zeroed (same dtype),
      metrics)``. Log-probs in fp16/bf16 are promoted first: the weights are fp32 (fp64 for fp64 inputs). With both ``rollout_is`` and ``rollout_rs`` None only the gap metrics are computed.

    Raises:
      ValueError: shapes differ, the mask has no model token, or an option/threshold is malformed.
      TypeError: ``rollout_is_threshold`` is neither a number nor a string.

    Any gap is handled: the weights are finite and exactly 0 outside the mask, and the mask is 0/1, for
    log-prob gaps of any size (exponents are clamped at ±20, verl's safety bound) and any junk (NaN, ±inf)
    outside the mask. Weights and masks depend on row-local values only (unless
    ``rollout_is_batch_normalize``), so calls per micro-batch give the same weights and masks as one call on
    the whole batch. Metrics saturate as
    verl's do: e.g. ``rollout_is_min`` of sequence IS and ``k3_kl`` / ``training_ppl`` are ``inf`` when the
    gap is large enough to overflow ``exp``, exactly where verl reports ``inf``.
    """
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ValueError(
            f"old_log_prob {tuple(old_log_prob.shape)}, rollout_log_prob {tuple(rollout_log_prob.shape)} and "
            f"response_mask {tuple(response_mask.shape)} must share one [B, T] shape"
        )
    if not response_mask.any():
        raise ValueError("response_mask has no model tokens; rollout correction needs at least one")
    mask_dtype = response_mask.dtype
    old_log_prob, rollout_log_prob, response_mask = promote(old_log_prob.detach(), rollout_log_prob.detach(),
                                                            response_mask)
    old_log_prob = masked(old_log_prob, response_mask)
    rollout_log_prob = masked(rollout_log_prob, response_mask)
    log_ratio = old_log_prob - rollout_log_prob
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        upper, lower = parse_is_threshold(rollout_is_threshold)
        raw, weights, log_for_metrics = _is_weights(log_ratio, response_mask, rollout_is, upper, lower)
        if with_metrics:
            metrics.update(_is_metrics(raw, weights, log_for_metrics, response_mask, rollout_is, upper, lower))
        weights = weights.detach()
        if rollout_is_batch_normalize:
            weights, norm_m = _batch_normalize(weights, response_mask, rollout_is, with_metrics)
            metrics.update(norm_m)
    new_mask = response_mask.clone()
    if rollout_rs is not None:
        new_mask, rs_m = _rs_mask(log_ratio, response_mask, rollout_rs, rollout_rs_threshold, with_metrics)
        metrics.update(rs_m)
    if with_metrics:
        metrics.update(_gap_metrics(old_log_prob, rollout_log_prob, response_mask))
    return weights, new_mask.to(mask_dtype), {f"rollout_corr/{k}": v for k, v in metrics.items()}
