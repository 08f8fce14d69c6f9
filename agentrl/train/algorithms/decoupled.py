"""Decoupled PPO: the clipped ratio against the proximal policy, the behaviour policy corrected separately.

Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language Reasoning",
https://arxiv.org/abs/2505.24298 (section 5.2), after Hilton et al. 2022, "Batch size-invariance for policy
optimization", https://arxiv.org/abs/2110.00641. Three policies meet in an asynchronous update:

- the behaviour policy ``pi_behav`` that sampled the tokens (possibly several older versions within one episode;
  its exact log-probs are the trajectory's ``rollout_logprobs``);
- the proximal policy ``pi_prox``, the weights before this update (their log-probs are the update's
  ``old_log_prob``: a separate no-grad pass, or, for a single optimizer step, the training forward detached);
- the policy being trained, ``pi_theta``.

Per token, with ``r = pi_theta / pi_prox`` and ``w = pi_prox / pi_behav``, the loss is ``w * L_clip(r, A)``:
the trust region is taken around ``pi_prox`` (the ratio is clipped there, not against a stale ``pi_behav``), and
``w`` corrects the sampling. ``w`` goes through the registry's rollout-correction modes
(:func:`~agentrl.train.algorithms.rollout_correction.rollout_correction`: truncated at an upper bound (TIS),
masked outside ``[lo, hi]`` (IcePop), and/or rejection by divergence), and ``L_clip`` is any registered policy
loss (:func:`~agentrl.train.algorithms.losses.policy_loss`). When behaviour and proximal agree (synchronous
training: ``w`` is 1 up to the engine's numerics) this is exactly the synchronous trainer's loss; it is the one
the trainer's update computes (:mod:`agentrl.train.update`).
"""

from __future__ import annotations

from typing import Any

import torch

from agentrl.train.algorithms._masked import masked, masked_max, masked_mean, promote
from agentrl.train.algorithms.losses import policy_loss
from agentrl.train.algorithms.rollout_correction import rollout_correction


def decoupled_ppo_loss(
    name: str,
    *,
    behaviour_log_prob: torch.Tensor,
    proximal_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str | None = None,
    rollout_is_threshold: float | str | None = 2.0,
    rollout_rs: str | None = None,
    rollout_rs_threshold: float | str | None = None,
    staleness: torch.Tensor | None = None,
    gap_metrics: bool = True,
    **loss_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """The decoupled PPO loss (module docstring) of the policy loss registered as ``name``.

    Args:
        name: a policy loss of :data:`~agentrl.train.algorithms.losses.POLICY_LOSSES` (``vanilla``: PPO's clip).
        behaviour_log_prob: ``[B, T]`` the sampler's log-probs of the tokens (``pi_behav``).
        proximal_log_prob: ``[B, T]`` the same under the weights before this update (``pi_prox``).
        log_prob: ``[B, T]`` the same under the policy being trained (differentiable).
        advantages: ``[B, T]``.
        response_mask: ``[B, T]``, 1 = a model token to train on.
        rollout_is, rollout_is_threshold, rollout_rs, rollout_rs_threshold: how ``w = pi_prox / pi_behav`` is
            truncated or masked (the modes of :func:`~agentrl.train.algorithms.rollout_correction.rollout_correction`);
            with ``rollout_is=None`` and ``rollout_rs=None`` there is no ``w`` (only right when behaviour and
            proximal are the same policy).
        staleness: optional ``[B, T]`` policy versions between each token's sampler and the proximal policy.
        gap_metrics: add the behaviour/proximal gap and staleness metrics (off where the caller computes them
            once over a whole batch).
        loss_kwargs: :func:`~agentrl.train.algorithms.losses.policy_loss`'s clip and aggregation arguments.

    Returns:
        ``(loss, metrics, mask)``: the 0-d loss, the policy loss's metrics (``actor/pg_clipfrac``,
        ``actor/ppo_kl``, the ratio ``pi_theta / pi_prox``) plus, with ``gap_metrics``,
        ``decoupled/behav_prox_abs_gap_mean|max`` (``|log pi_prox - log pi_behav|``),
        ``decoupled/kept_fraction`` (tokens left by rejection) and ``decoupled/staleness_mean|max``; and the
        mask the loss was taken over (``response_mask`` less the rejected tokens). An all-zero mask gives a loss
        of 0 and no gap metric.

    Raises:
        ValueError: an unknown loss or correction option, or inputs of different shapes.
    """
    weights, mask = None, response_mask
    if response_mask.any() and (rollout_is is not None or rollout_rs is not None):
        weights, mask, _ = rollout_correction(
            old_log_prob=proximal_log_prob, rollout_log_prob=behaviour_log_prob, response_mask=response_mask,
            rollout_is=rollout_is, rollout_is_threshold=rollout_is_threshold, rollout_rs=rollout_rs,
            rollout_rs_threshold=rollout_rs_threshold, with_metrics=False,
        )
    loss, metrics = policy_loss(name, old_log_prob=proximal_log_prob, log_prob=log_prob, advantages=advantages,
                                response_mask=mask, rollout_is_weights=weights, **loss_kwargs)
    if gap_metrics and response_mask.any():
        metrics.update(_gap_metrics(behaviour_log_prob, proximal_log_prob, response_mask, mask, staleness))
    return loss, metrics, mask


def _gap_metrics(behaviour: torch.Tensor, proximal: torch.Tensor, mask: torch.Tensor, kept: torch.Tensor,
                 staleness: torch.Tensor | None) -> dict[str, float]:
    behaviour, proximal, mask, kept = promote(behaviour.detach(), proximal.detach(), mask, kept)
    gap = masked((proximal - behaviour).abs(), mask)
    out = {
        "decoupled/behav_prox_abs_gap_mean": masked_mean(gap, mask).item(),
        "decoupled/behav_prox_abs_gap_max": masked_max(gap, mask).item(),
        "decoupled/kept_fraction": (kept.sum() / mask.sum()).item(),
    }
    if staleness is not None:
        lag = masked(staleness.to(gap.dtype), mask)
        out["decoupled/staleness_mean"] = masked_mean(lag, mask).item()
        out["decoupled/staleness_max"] = masked_max(lag, mask).item()
    return out
