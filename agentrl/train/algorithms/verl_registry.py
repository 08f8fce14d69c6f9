"""Register agentrl's policy losses in verl's policy-loss registry (for the verl backend).

verl is optional: import this module only where verl is installed. :func:`register_all` is idempotent.

Registered names:
  ``agentrl_onpolicy``: the PPO clipped loss (dual clip as verl's ``vanilla``) with the on-policy fix:
    ``old_log_prob`` is replaced by ``log_prob.detach()`` so the ratio is exactly 1. Select it only when
    each rollout batch gets one optimizer step (``ppo_epochs=1`` and one mini-batch); it raises if
    ``config.ppo_epochs > 1``. Metrics add ``actor/onpolicy_fix = 1.0``.
"""

from __future__ import annotations

from agentrl.train.algorithms.losses import policy_loss

ONPOLICY_LOSS_NAME = "agentrl_onpolicy"


def _cfg(config, key, default=None):
    return config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)


def agentrl_onpolicy_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="token-mean",
    config=None,
    rollout_is_weights=None,
):
    """verl ``PolicyLossFn`` signature; see the module docstring."""
    if config is None:
        raise ValueError("agentrl_onpolicy needs verl's actor config (clip_ratio, ppo_epochs, ...)")
    epochs = _cfg(config, "ppo_epochs", 1)
    if epochs != 1:
        raise ValueError(
            f"policy loss {ONPOLICY_LOSS_NAME!r} is only valid with ppo_epochs=1 and one mini-batch "
            f"(got ppo_epochs={epochs}); use 'vanilla' for multi-epoch PPO"
        )
    batch_info = dict(_cfg(config, "global_batch_info", None) or {})
    loss, metrics = policy_loss(
        "vanilla",
        old_log_prob=log_prob.detach(),
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        clip_ratio=_cfg(config, "clip_ratio", 0.2),
        clip_ratio_low=_cfg(config, "clip_ratio_low"),
        clip_ratio_high=_cfg(config, "clip_ratio_high"),
        clip_ratio_c=_cfg(config, "clip_ratio_c", 3.0),
        rollout_is_weights=rollout_is_weights,
        batch_num_tokens=batch_info.get("batch_num_tokens"),
        global_batch_size=batch_info.get("global_batch_size"),
    )
    metrics["actor/onpolicy_fix"] = 1.0
    return loss, metrics


def register_all() -> list[str]:
    """Add agentrl's losses to verl's registry (``core_algos.register_policy_loss``); returns the names."""
    from verl.trainer.ppo import core_algos

    core_algos.register_policy_loss(ONPOLICY_LOSS_NAME)(agentrl_onpolicy_loss)
    return [ONPOLICY_LOSS_NAME]
