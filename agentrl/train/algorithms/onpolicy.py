"""The on-policy log-prob fix.

PPO's ratio ``pi_theta / pi_old`` is meant to be exactly 1 on the first (and, on-policy, only) optimizer
step of a rollout batch. Computing ``old_log_prob`` in a separate no-grad pass breaks that: a different
micro-batch composition, padding length or kernel path changes the bf16 arithmetic, and in a MoE model a
near-tie in the router can flip an expert, so ``old`` and ``new`` log-probs differ by noise. Clipping then
fires on pure noise (nonzero ``actor/pg_clipfrac`` at step 0) and biases the gradient.

Why it matters for MoE models and RL from an inference engine generally: Liu et al. 2025, "When Speed Kills
Stability: Demystifying RL Collapse from the Training-Inference Mismatch", https://richardli.xyz/rl-collapse;
the clipped objective is PPO's (Schulman et al. 2017, https://arxiv.org/abs/1707.06347).

The fix (as in verl 0.7's ``dp_actor``, dropped in 0.9): when a rollout batch gets exactly one optimizer
step over all its rows, use ``old_log_prob = log_prob.detach()`` taken from the very forward that
produces the gradient. The ratio is then 1 by construction and the clipped loss reduces to the policy
gradient ``-A * grad log pi``. With several steps the later ones are genuinely off-policy, so the
separate pass is required and the fix is off.

What counts is the number of steps that actually run, not the configured ``ppo_epochs`` x
``num_mini_batches``: the trainer decides after dropping unusable episodes and after chunking (two
configured mini-batches over one usable row are one step), see :mod:`agentrl.train.update`.
"""

from __future__ import annotations

import torch


def is_on_policy(*, optimizer_steps: int) -> bool:
    """True iff the rollout batch gets exactly one optimizer step (over all its rows)."""
    if optimizer_steps < 0:
        raise ValueError(f"optimizer_steps must be >= 0, got {optimizer_steps}")
    return optimizer_steps == 1


def onpolicy_old_log_prob(log_prob: torch.Tensor, *, optimizer_steps: int) -> torch.Tensor | None:
    """``log_prob.detach()`` when :func:`is_on_policy`, else None (use the separately computed old log-probs).

    Args:
        log_prob: ``[B, T]`` log-probs of the sampled tokens from the training forward that the loss
            backpropagates through.
        optimizer_steps: optimizer steps the rollout batch really gets.

    Returns:
        ``[B, T]`` detached old log-probs (the PPO ratio is then exactly 1), or None.

    Raises:
        ValueError: ``optimizer_steps < 0``.
    """
    return log_prob.detach() if is_on_policy(optimizer_steps=optimizer_steps) else None
