"""RL algorithms as pure tensor functions in name registries (no verl needed).

Decision on verl: the trainer must run where verl is absent (the GPU machine, the default CPU path), so
these are our own pure-torch implementations of verl 0.9.1's estimators, losses, KL estimators and rollout
correction, proven equal to verl's on random inputs by ``tests/test_algos_parity.py`` and the hypothesis
property tests of ``tests/test_algos_properties.py`` (run wherever verl is installed, e.g. CI). Where verl's
results are rounding artefacts or NaN from junk outside the mask, ours are exact and finite (see the
modules' docstrings). :mod:`agentrl.train.verl_backend.losses` registers our extra losses into verl's
registry for the verl backend.

Public API:
  compute_advantages(name, ...) -> (advantages, returns)      names: ADVANTAGE_ESTIMATORS
  policy_loss(name, ...) -> (loss, metrics)                   names: POLICY_LOSSES
  agg_loss(loss_mat, loss_mask, loss_agg_mode)
  kl_penalty(log_prob, ref_log_prob, kind)
  rollout_correction(...) -> (is_weights | None, response_mask, metrics)
  decoupled_ppo_loss(name, ...) -> (loss, metrics, mask)      AReaL's decoupled PPO over any policy loss
  is_on_policy(optimizer_steps=), onpolicy_old_log_prob(log_prob, optimizer_steps=)
"""

from agentrl.train.algorithms.advantages import ADVANTAGE_ESTIMATORS, compute_advantages, register_advantage
from agentrl.train.algorithms.decoupled import decoupled_ppo_loss
from agentrl.train.algorithms.losses import (
    KL_KINDS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    ClipConfig,
    agg_loss,
    kl_penalty,
    policy_loss,
    register_policy_loss,
)
from agentrl.train.algorithms.onpolicy import is_on_policy, onpolicy_old_log_prob
from agentrl.train.algorithms.rollout_correction import rollout_correction

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "ClipConfig",
    "agg_loss",
    "compute_advantages",
    "decoupled_ppo_loss",
    "is_on_policy",
    "kl_penalty",
    "onpolicy_old_log_prob",
    "policy_loss",
    "register_advantage",
    "register_policy_loss",
    "rollout_correction",
]
