"""The agentrl verl plugin, loaded by ``import verl`` through the ``verl.plugins`` entry point.

verl imports every ``verl.plugins`` entry point at the end of ``verl/__init__.py``, in the driver and in
every Ray worker, so importing this module is what makes agentrl available inside verl:

- the ``agentrl`` agent loop (:mod:`agentrl.train.verl_backend.agent_loop`) in verl's agent-loop registry;
- agentrl's policy losses (``agentrl_onpolicy`` and ``agentrl_onpolicy_<base>``: the on-policy log-prob fix
  composed with verl's own losses) in verl's policy-loss registry, through
  :func:`agentrl.train.verl_backend.losses.register_all`, and the update guard that lets those losses
  refuse a stale ``old_log_prob`` (:func:`~agentrl.train.verl_backend.losses.install_update_guard`);
- sink attention as the transformers attention implementation ``agentrl_sink``, Ulysses-aware
  (:mod:`agentrl.train.verl_backend.ulysses`), selectable with
  ``actor_rollout_ref.model.override_config.attn_implementation=agentrl_sink``;
- the ``agentrl`` rollout (``actor_rollout_ref.rollout.name=agentrl``: agentrl's transformers engine in
  verl's hybrid-engine workers) in verl's two rollout registries, through
  :func:`agentrl.train.verl_backend.rollout_backend.register_rollout`;
- the ``agentrl`` logger backend (``trainer.logger=[console,agentrl]``: verl's per-step metrics into
  ``RUN_DIR/metrics.jsonl`` and TensorBoard), through
  :func:`agentrl.train.verl_backend.tracking.register_tracking`.

verl logs plugin failures only at debug level, so each part is registered separately and a failure is
logged as a warning here and kept in :data:`FAILED` (what failed -> why); :data:`REGISTERED` maps each
part to the names it registered. ``VERL_USE_EXTERNAL_PLUGINS=none`` turns every plugin off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger("agentrl.verl")

REGISTERED: dict[str, list[str]] = {}
FAILED: dict[str, str] = {}


def _agent_loop() -> list[str]:
    from agentrl.train.verl_backend.agent_loop import AGENT_NAME

    return [AGENT_NAME]


def _policy_losses() -> list[str]:
    from agentrl.train.verl_backend.losses import install_update_guard, register_all

    names = list(register_all())
    install_update_guard()
    return names


def _attention() -> list[str]:
    from agentrl.train.verl_backend.ulysses import register_ulysses_sink_attention

    return [register_ulysses_sink_attention()]


def _rollout() -> list[str]:
    from agentrl.train.verl_backend.rollout_backend import register_rollout

    return register_rollout()


def _tracking() -> list[str]:
    from agentrl.train.verl_backend.tracking import register_tracking

    return register_tracking()


PARTS: dict[str, Callable[[], list[str]]] = {
    "agent_loop": _agent_loop,
    "policy_loss": _policy_losses,
    "attention": _attention,
    "rollout": _rollout,
    "tracking": _tracking,
}


def load() -> dict[str, list[str]]:
    """Register every part (idempotent); returns :data:`REGISTERED`."""
    for part, register in PARTS.items():
        try:
            REGISTERED[part] = register()
            FAILED.pop(part, None)
        except Exception as exc:  # a broken part must not break `import verl` for the others
            FAILED[part] = f"{type(exc).__name__}: {exc}"
            logger.warning("agentrl verl plugin: registering %s failed: %s", part, FAILED[part])
    return REGISTERED


load()
