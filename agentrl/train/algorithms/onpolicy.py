"""The on-policy log-prob fix.

PPO's ratio ``pi_theta / pi_old`` is meant to be exactly 1 on the first (and, on-policy, only) optimizer
step of a rollout batch. Computing ``old_log_prob`` in a separate no-grad pass breaks that: a different
micro-batch composition, padding length or kernel path changes the bf16 arithmetic, and in a MoE model a
near-tie in the router can flip an expert, so ``old`` and ``new`` log-probs differ by noise. Clipping then
fires on pure noise (nonzero ``actor/pg_clipfrac`` at step 0) and biases the gradient.

The fix (as in verl 0.7's ``dp_actor``, dropped in 0.9): when each rollout batch gets exactly one
optimizer step (one PPO epoch and one mini-batch), use ``old_log_prob = log_prob.detach()`` taken from
the very forward that produces the gradient. The ratio is then 1 by construction and the clipped loss
reduces to the policy gradient ``-A * grad log pi``. With several epochs or mini-batches the later
steps are genuinely off-policy, so the separate pass is required and the fix is off.
"""

from __future__ import annotations

import torch


def is_on_policy(ppo_epochs: int, num_mini_batches: int) -> bool:
    """True iff a rollout batch gets exactly one optimizer step (``ppo_epochs == num_mini_batches == 1``)."""
    if ppo_epochs < 1 or num_mini_batches < 1:
        raise ValueError(f"ppo_epochs ({ppo_epochs}) and num_mini_batches ({num_mini_batches}) must be >= 1")
    return ppo_epochs == 1 and num_mini_batches == 1


def onpolicy_old_log_prob(
    log_prob: torch.Tensor, *, ppo_epochs: int, num_mini_batches: int
) -> torch.Tensor | None:
    """``log_prob.detach()`` when :func:`is_on_policy`, else None (use the separately computed old log-probs).

    ``log_prob`` is the ``[B, T]`` tensor of the training forward that the loss backpropagates through.
    """
    return log_prob.detach() if is_on_policy(ppo_epochs, num_mini_batches) else None
