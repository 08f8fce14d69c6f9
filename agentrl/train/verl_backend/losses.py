"""The on-policy fix as verl policy losses (for the verl backend; the pure-torch algorithms are in
:mod:`agentrl.train.algorithms`).

verl is optional: import this module only where verl is installed. :func:`register_all` is idempotent.

Registered names (:func:`onpolicy_loss_name`):
  ``agentrl_onpolicy``: verl's ``vanilla`` (PPO clip, dual clip) with the on-policy fix;
  ``agentrl_onpolicy_<base>``: verl's ``<base>`` loss (``gspo``, ``cispo``, ``sapo``, ...) with the fix,
    for every loss in verl's registry at registration time except :data:`NOT_COMPOSABLE`.

The fix: ``old_log_prob`` is replaced by ``log_prob.detach()``, then verl's own ``<base>`` function runs
with everything else unchanged (``config.global_batch_info``: ``dp_size``, ``batch_num_tokens``,
``global_batch_size``, ``loss_scale_factor``; clip ratios; rollout-correction weights). The result is
therefore verl's loss at ``old_log_prob = log_prob.detach()`` for every aggregation mode and data-parallel
size, by construction. Metrics add ``actor/onpolicy_fix = 1`` and ``actor/onpolicy_recompute_gap_max``,
the largest ``|old_log_prob - log_prob|`` over the micro-batch's tokens: how far verl's separate
old-log-prob pass was from the training forward (the noise the fix removes from the ratio).

The fix is valid only when the update is one optimizer step on the batch whose ``old_log_prob`` verl
computed; on a later step that ``old_log_prob`` is stale. It is detected, not trained on
(:class:`StaleOldLogProbError` before any backward):
  - ``config.ppo_epochs != 1``;
  - :func:`install_update_guard` (run by the agentrl verl plugin in every worker) wraps verl's mini-batch
    iterator (``verl.utils.tensordict_utils.make_iterator``, which verl's ``train_mini_batch`` uses to
    split each update into optimizer steps) and records how many steps the current update really makes;
    the loss refuses when that is more than one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from agentrl.train.algorithms._masked import masked, masked_max
from agentrl.train.verl_backend.config_map import NOT_COMPOSABLE, ONPOLICY_LOSS, fix_base, onpolicy_loss_name

ONPOLICY_LOSS_NAME = ONPOLICY_LOSS


class StaleOldLogProbError(RuntimeError):
    """The on-policy loss was reached on an update that makes more than one optimizer step."""


# ---------------------------------------------------------------------------- the update guard
_GUARD: dict[str, Any] = {"steps": None, "owner": None}


def current_update_steps() -> int | None:
    """Optimizer steps of the update verl is running in this process (None: not known, e.g. no guard)."""
    return _GUARD["steps"]


def install_update_guard() -> bool:
    """Wrap ``verl.utils.tensordict_utils.make_iterator`` so that, while an update iterates over its
    mini-batches, :func:`current_update_steps` is its optimizer-step count (``ceil(rows / mini_batch_size)
    * epochs``). Idempotent; returns True once the wrapper is in place. An iterator left unfinished (an update
    that raised) clears the count when it is closed or collected, only if no later update has set it since,
    and also when that happens at interpreter exit, after this module's globals are gone."""
    from verl.utils import tensordict_utils

    original = tensordict_utils.make_iterator
    if getattr(original, "_agentrl_guard", False):
        return True
    guard = _GUARD  # bound in the closure: no global lookup in the generator's finally

    def guarded(batches, steps):
        owner = object()
        guard["steps"], guard["owner"] = steps, owner  # from the first mini-batch until the update's last one is done
        try:
            yield from batches
        finally:
            if guard["owner"] is owner:
                guard["steps"], guard["owner"] = None, None

    @functools.wraps(original)
    def make_iterator(tensordict, mini_batch_size, epochs, *args, **kwargs):
        steps = math.ceil(int(tensordict.batch_size[0]) / max(int(mini_batch_size), 1)) * int(epochs)
        return guarded(original(tensordict, mini_batch_size, epochs, *args, **kwargs), steps)

    make_iterator._agentrl_guard = True
    tensordict_utils.make_iterator = make_iterator
    return True


# ---------------------------------------------------------------------------- the losses
def _cfg(config: Any, key: str, default: Any = None) -> Any:
    return config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)


def _check_fresh(name: str, config: Any) -> None:
    epochs = _cfg(config, "ppo_epochs", 1)
    if epochs != 1:
        raise StaleOldLogProbError(
            f"policy loss {name!r} got ppo_epochs={epochs}: every epoch after the first would train on a stale "
            "old_log_prob. Use it with ppo_epochs=1 and one mini-batch per step (agentrl picks it only then), "
            "or use the plain loss for multi-step PPO"
        )
    steps = current_update_steps()
    if steps is not None and steps != 1:
        _GUARD["steps"] = None  # this update ends here
        raise StaleOldLogProbError(
            f"policy loss {name!r} reached an update of {steps} optimizer steps (mini-batches x epochs): from "
            "the second step on, verl's old_log_prob is stale and the on-policy fix would hide it. Nothing "
            "was trained. Make actor_rollout_ref.actor.ppo_mini_batch_size equal data.train_batch_size (and "
            "ppo_epochs=1), or use the plain loss"
        )


def make_onpolicy_loss(base: str) -> Callable[..., tuple[torch.Tensor, dict[str, Any]]]:
    """verl ``PolicyLossFn``: verl's ``base`` loss at ``old_log_prob = log_prob.detach()``."""
    if base in NOT_COMPOSABLE:
        raise ValueError(f"the on-policy fix cannot be composed with {base!r}: {NOT_COMPOSABLE[base]}")
    name = onpolicy_loss_name(base)

    def loss_fn(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode="token-mean",
        config=None,
        rollout_is_weights=None,
    ):
        from verl.trainer.ppo.core_algos import get_policy_loss_fn

        if config is None:
            raise ValueError(f"{name} needs verl's actor config (clip ratios, global_batch_info, ...)")
        _check_fresh(name, config)
        gap = masked_max(masked((old_log_prob - log_prob.detach()).abs(), response_mask), response_mask)
        loss, metrics = get_policy_loss_fn(base)(
            log_prob.detach(), log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
        )
        metrics = dict(metrics)
        metrics["actor/onpolicy_fix"] = 1.0
        metrics["actor/onpolicy_recompute_gap_max"] = float(gap) if response_mask.any() else 0.0
        return loss, metrics

    loss_fn.__name__ = loss_fn.__qualname__ = name
    loss_fn.__doc__ = f"verl's {base!r} policy loss with old_log_prob = log_prob.detach() (the on-policy fix)."
    return loss_fn


def register_all() -> list[str]:
    """Register the on-policy fix composed with every loss in verl's registry (``core_algos``); returns the
    registered names, ``agentrl_onpolicy`` first."""
    from verl.trainer.ppo import core_algos

    bases = [
        b for b in core_algos.POLICY_LOSS_REGISTRY
        if b not in NOT_COMPOSABLE and fix_base(b) is None
    ]
    names = []
    for base in sorted(bases, key=lambda b: b != "vanilla"):
        name = onpolicy_loss_name(base)
        core_algos.register_policy_loss(name)(make_onpolicy_loss(base))
        names.append(name)
    return names
