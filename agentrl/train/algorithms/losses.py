"""Loss aggregation, KL estimators and policy losses (PPO clip family), selected by name.

Our own implementations of verl 0.9.1's ``agg_loss``, ``kl_penalty`` and the ``vanilla`` / ``gspo`` /
``cispo`` policy losses (same maths, clamps and metric names; checked against verl in
``tests/test_algos_parity.py``). The trainer runs without verl installed.

Shapes: ``old_log_prob``, ``log_prob``, ``advantages``, ``response_mask`` and ``rollout_is_weights`` are
``[B, T]``; log-probs are natural-log probabilities of the sampled tokens (fp32 recommended).

Positions outside ``response_mask`` never reach a loss, a gradient or a metric, whatever they hold:
:func:`policy_loss` selects its inputs (``torch.where``) before any arithmetic, so ``NaN``/``inf`` in
padding gives a finite loss and a zero gradient there; :func:`agg_loss` selects its loss matrix, so the
value is finite and the gradient it sends back there is exactly 0. verl multiplies by the mask instead,
so its sequence-level aggregations and its gradients turn such junk into NaN; on finite inputs the two
agree to rounding.

Every function promotes fp16/bf16 inputs to fp32 before any arithmetic (gradients flow back through the
cast; see :func:`~agentrl.train.algorithms._masked.promote`), so losses, KL estimates and metrics come
back in fp32: in fp16 ``exp`` of a log-ratio above 11 is ``inf`` and a token count above 2048 rounds.
An all-zero mask gives a loss of exactly 0 (verl divides 0 by 0: NaN), and statistics over no token are
left out of the metrics rather than reported as ``±inf`` (:func:`policy_loss`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from agentrl.train.algorithms._masked import masked, masked_max, masked_mean, masked_min, masked_sum, promote

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
_LOG_RATIO_CLAMP = 20.0


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    dp_size: int = 1,
    batch_num_tokens: float | torch.Tensor | None = None,
    global_batch_size: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar (verl's ``agg_loss``, same keyword arguments).

    ``token-mean`` is the token-level loss of DAPO (Yu et al. 2025, https://arxiv.org/abs/2503.14476);
    ``seq-mean-token-mean`` GRPO's original (https://arxiv.org/abs/2402.03300); ``seq-mean-token-sum-norm``
    the constant-normaliser loss of Dr. GRPO (https://arxiv.org/abs/2503.20783).

    Args:
        loss_mat: ``[B, T]`` float per-token loss.
        loss_mask: ``[B, T]``, 1 = a token that counts.
        loss_agg_mode: one of :data:`LOSS_AGG_MODES` (below).
        dp_size, batch_num_tokens, global_batch_size, loss_scale_factor: see below.

    Returns:
        A 0-d float tensor (differentiable through ``loss_mat``).

    Raises:
        ValueError: an unknown mode, ``dp_size > 1`` without the global totals, ``loss_scale_factor <= 0``.

    Modes:
      ``token-mean``: sum over unmasked tokens / ``batch_num_tokens`` (default: unmasked tokens here).
      ``token-sum``: sum over unmasked tokens.
      ``seq-mean-token-sum``: per-row token sum, averaged over rows that have a token
        (divided by ``global_batch_size`` if given).
      ``seq-mean-token-mean``: per-row token mean, averaged likewise.
      ``seq-mean-token-sum-norm``: ``seq-mean-token-sum`` / ``loss_scale_factor`` (default: T).
    Pass ``batch_num_tokens`` / ``global_batch_size`` (totals over all micro-batches of an optimizer step,
    over all data-parallel ranks) when accumulating gradients over micro-batches, so the sum of micro-batch
    losses equals the full loss. verl's trainer passes the token total of the mini-batch's loss mask (after
    rejection sampling) and its row count (``ppo_mini_batch_size * rollout.n``: every row, also one that
    rejection emptied). ``dp_size`` multiplies the result (every mode), so that the data-parallel gradient
    average equals the gradient of the global loss; with ``dp_size > 1`` the global totals are required
    (verl's rule). With the default totals an all-zero mask gives exactly 0 (verl: 0 / 0).
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; choose one of {list(LOSS_AGG_MODES)}")
    if loss_scale_factor is not None and not loss_scale_factor > 0:
        raise ValueError(f"loss_scale_factor must be > 0 (seq-mean-token-sum-norm divides by it), got {loss_scale_factor}")
    loss_mat, loss_mask = promote(loss_mat, loss_mask)
    loss_mat = masked(loss_mat, loss_mask)
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("token-mean with dp_size > 1 needs the global batch_num_tokens")
            batch_num_tokens = loss_mask.sum().clamp(min=1)  # no token: the sum is 0, and so is the loss
        return masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask) * dp_size
    tokens_per_row = loss_mask.sum(dim=-1)
    row_loss = (loss_mat * loss_mask).sum(dim=-1)
    if loss_agg_mode == "seq-mean-token-mean":
        row_loss = row_loss / (tokens_per_row + 1e-8)
    rows = (tokens_per_row > 0).to(loss_mat.dtype)
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError(f"{loss_agg_mode} with dp_size > 1 needs the global global_batch_size")
        global_batch_size = rows.sum().clamp(min=1)
    loss = masked_sum(row_loss, rows) / global_batch_size * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


KL_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate from sampled-token log-probs.

    The k1/k2/k3 estimators of Schulman 2020, "Approximating KL Divergence",
    http://joschu.net/blog/kl-approx.html.

    Args:
        log_prob: ``[B, T]`` log-probs of the sampled tokens under the policy.
        ref_log_prob: ``[B, T]`` the same tokens under the reference policy.
        kind: one of :data:`KL_KINDS`, optionally with a trailing ``+``.

    Returns:
        ``[B, T]`` float per-token estimates (mask them with the response mask).

    Raises:
        ValueError: an unknown ``kind``.

    ``k1``/``kl``: ``logp - ref``; ``abs``: ``|logp - ref|``; ``k2``/``mse``: ``0.5 (logp - ref)^2``;
    ``k3``/``low_var_kl``: ``exp(ref - logp) - (ref - logp) - 1`` with the log-ratio clamped to ±20 and the
    result to ±10. A trailing ``+`` (e.g. ``k3+``) keeps the forward value but takes the gradient of k2
    (straight-through), which is the unbiased KL gradient.
    """
    straight_through = kind.endswith("+")
    base = kind[:-1] if straight_through else kind
    log_prob, ref_log_prob = promote(log_prob, ref_log_prob)
    diff = log_prob - ref_log_prob
    if base in ("k1", "kl"):
        value = diff
    elif base == "abs":
        value = diff.abs()
    elif base in ("k2", "mse"):
        value = 0.5 * diff.square()
    elif base in ("k3", "low_var_kl"):
        rev = torch.clamp(-diff, min=-_LOG_RATIO_CLAMP, max=_LOG_RATIO_CLAMP)
        value = torch.clamp(torch.exp(rev) - rev - 1, min=-10.0, max=10.0)
    else:
        raise ValueError(
            f"unknown KL estimator {kind!r}; choose one of {list(KL_KINDS)} (optionally with '+')"
        )
    if not straight_through or base in ("k2", "mse"):
        return value
    grad_carrier = 0.5 * diff.square()
    return grad_carrier - grad_carrier.detach() + value.detach()


@dataclass(frozen=True)
class ClipConfig:
    """PPO clip parameters. ``low``/``high`` default to ``ratio``; ``c`` is the dual-clip bound (> 1)."""

    ratio: float = 0.2
    low: float | None = None
    high: float | None = None
    c: float = 3.0

    @property
    def lo(self) -> float:
        return self.ratio if self.low is None else self.low

    @property
    def hi(self) -> float:
        return self.ratio if self.high is None else self.high


PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator adding a loss to :data:`POLICY_LOSSES`. Signature of a loss:
    ``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, clip: ClipConfig,
    rollout_is_weights, agg_kwargs: dict) -> (loss, metrics)``."""

    def deco(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        return fn

    return deco


def _ratio_metrics(ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean, max and min of the ratio over the masked tokens; none of them when the mask is empty."""
    if not mask.any():
        return {}
    return {
        "actor/ppo_ratio_mean": masked_mean(ratio, mask).item(),
        "actor/ppo_ratio_max": masked_max(ratio, mask).item(),
        "actor/ppo_ratio_min": masked_min(ratio, mask).item(),
    }


@register_policy_loss("vanilla")
def vanilla(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, clip, rollout_is_weights, agg_kwargs
):
    """PPO clipped surrogate with dual clip for negative advantages (ratio capped at ``clip.c``).

    Schulman et al. 2017, "Proximal Policy Optimization Algorithms", https://arxiv.org/abs/1707.06347; dual
    clip: Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning",
    https://arxiv.org/abs/1912.09729; asymmetric bounds (``clip.high > clip.low``, "clip-higher"): DAPO,
    https://arxiv.org/abs/2503.14476.

    Args (all ``[B, T]`` unless said): old_log_prob, log_prob (differentiable), advantages, response_mask;
    loss_agg_mode; clip: :class:`ClipConfig`; rollout_is_weights: ``[B, T]`` or None; agg_kwargs: for
    :func:`agg_loss`.

    Returns:
        ``(loss, metrics)``: a 0-d tensor and ``actor/pg_clipfrac``, ``actor/ppo_kl``,
        ``actor/pg_clipfrac_lower``, ``actor/ppo_ratio_mean|max|min``.

    Raises:
        ValueError: ``clip.c <= 1``.
    """
    if clip.c <= 1.0:
        raise ValueError(f"dual-clip bound clip_ratio_c must be > 1.0, got {clip.c}")
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-_LOG_RATIO_CLAMP, max=_LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip.lo, 1 + clip.hi)
    ppo_loss = torch.maximum(unclipped, clipped)
    dual = -advantages * clip.c
    dual_loss = torch.minimum(dual, ppo_loss)
    losses = torch.where(advantages < 0, dual_loss, ppo_loss)
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights
    loss = agg_loss(losses, response_mask, loss_agg_mode, **agg_kwargs)
    metrics = {
        "actor/pg_clipfrac": masked_mean((clipped > unclipped).float(), response_mask).item(),
        "actor/ppo_kl": masked_mean(-log_ratio, response_mask).item(),
        "actor/pg_clipfrac_lower": masked_mean(
            (ppo_loss > dual).float() * (advantages < 0).float(), response_mask
        ).item(),
    }
    metrics.update(_ratio_metrics(ratio.detach(), response_mask))
    return loss, metrics


@register_policy_loss("gspo")
def gspo(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, clip, rollout_is_weights, agg_kwargs
):
    """GSPO: sequence-level ratio ``exp(mean_t log(pi/pi_old))`` with per-token gradients, clipped.

    Zheng et al. 2025, "Group Sequence Policy Optimization", https://arxiv.org/abs/2507.18071 (the
    GSPO-token form: every token of a row carries the row's ratio, the gradient flows per token).

    Args and returns: as :func:`vanilla` (``[B, T]`` inputs, ``(loss, metrics)``; no dual clip, so
    ``actor/pg_clipfrac_lower`` is 0).
    """
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_sum(log_ratio, response_mask, dim=-1) / response_mask.sum(dim=-1).clamp(min=1)
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip.lo, 1 + clip.hi)
    losses = torch.maximum(unclipped, clipped)
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights
    loss = agg_loss(losses, response_mask, loss_agg_mode, **agg_kwargs)
    metrics = {
        "actor/pg_clipfrac": masked_mean((clipped > unclipped).float(), response_mask).item(),
        "actor/ppo_kl": masked_mean(-log_ratio, response_mask).item(),
        "actor/pg_clipfrac_lower": 0.0,
    }
    metrics.update(_ratio_metrics(ratio.detach(), response_mask))
    return loss, metrics


@register_policy_loss("cispo")
def cispo(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, clip, rollout_is_weights, agg_kwargs
):
    """CISPO: ``-sg(clip(ratio)) * A * log_prob`` (the clipped ratio is a stopped-gradient weight).

    MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention",
    https://arxiv.org/abs/2506.13585: clipping the importance weight instead of the update keeps every
    token's gradient.

    Args and returns: as :func:`vanilla` (``[B, T]`` inputs, ``(loss, metrics)``;
    ``actor/pg_clipfrac`` counts tokens whose ratio was clipped).
    """
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-_LOG_RATIO_CLAMP, max=_LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - clip.lo, 1 + clip.hi)
    losses = -clipped.detach() * advantages * log_prob
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights
    loss = agg_loss(losses, response_mask, loss_agg_mode, **agg_kwargs)
    metrics = {
        "actor/pg_clipfrac": masked_mean((ratio != clipped).float(), response_mask).item(),
        "actor/ppo_kl": masked_mean(-log_ratio, response_mask).item(),
        "actor/pg_clipfrac_lower": 0.0,
    }
    metrics.update(_ratio_metrics(ratio.detach(), response_mask))
    return loss, metrics


def policy_loss(
    name: str,
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: torch.Tensor | None = None,
    dp_size: int = 1,
    batch_num_tokens: float | torch.Tensor | None = None,
    global_batch_size: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar policy loss (to minimise) and metrics for the loss registered as ``name``.

    Args:
        name: one of :data:`POLICY_LOSSES` (``vanilla``, ``gspo``, ``cispo``; see each for its paper).
        old_log_prob: ``[B, T]`` log-probs of the sampled tokens under the policy that sampled the batch.
        log_prob: ``[B, T]`` the same under the current policy (differentiable).
        advantages: ``[B, T]``.
        response_mask: ``[B, T]``, 1 = model token.
        loss_agg_mode: see :func:`agg_loss`.
        clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c: :class:`ClipConfig`.
        rollout_is_weights: ``[B, T]`` detached rollout-correction weights, or None.

    Returns:
        ``(loss, metrics)``: a 0-d tensor and a dict of floats (fp32, or fp64 for fp64 inputs).

    Raises:
        ValueError: an unknown name (listing the valid ones) or inputs of different shapes.

    Metrics use verl's names: ``actor/pg_clipfrac`` (fraction of unmasked tokens where clipping bound),
    ``actor/ppo_kl`` (mean ``old - new`` log-prob), ``actor/pg_clipfrac_lower`` (dual-clip fraction), plus
    ``actor/ppo_ratio_mean|max|min`` (the importance ratio pi/pi_old over unmasked tokens). With an
    all-zero mask verl's three are 0, as in verl, and the ratio statistics are left out (there is no ratio).
    ``rollout_is_weights`` (``[B, T]``, detached) multiply the per-token losses (rollout correction).
    ``dp_size``, ``batch_num_tokens``, ``global_batch_size`` and ``loss_scale_factor`` go to
    :func:`agg_loss` (verl's ``global_batch_info``). Inputs outside ``response_mask`` are ignored, whatever
    they hold (see the module docstring).
    """
    fn = POLICY_LOSSES.get(name)
    if fn is None:
        raise ValueError(f"unknown policy loss {name!r}; choose one of {sorted(POLICY_LOSSES)}")
    shapes = {
        k: tuple(v.shape)
        for k, v in dict(
            old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask
        ).items()
    }
    if len(set(shapes.values())) != 1:
        raise ValueError(f"policy_loss inputs must share one [B, T] shape, got {shapes}")
    agg_kwargs = {
        k: v
        for k, v in dict(
            dp_size=dp_size,
            batch_num_tokens=batch_num_tokens,
            global_batch_size=global_batch_size,
            loss_scale_factor=loss_scale_factor,
        ).items()
        if v is not None
    }
    clip = ClipConfig(ratio=clip_ratio, low=clip_ratio_low, high=clip_ratio_high, c=clip_ratio_c)
    old_log_prob, log_prob, advantages, response_mask, rollout_is_weights = promote(
        old_log_prob, log_prob, advantages, response_mask, rollout_is_weights
    )
    old_log_prob, log_prob, advantages = (masked(t, response_mask) for t in (old_log_prob, log_prob, advantages))
    if rollout_is_weights is not None:
        rollout_is_weights = masked(rollout_is_weights, response_mask)
    return fn(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, clip, rollout_is_weights, agg_kwargs
    )
