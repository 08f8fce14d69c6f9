"""The agentrl verl plugin: loaded by `import verl` through the entry point; our policy loss through verl."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("verl")

_PROBE = r"""
import json, verl
from transformers import AttentionInterface
from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
from verl.workers.rollout.base import _ROLLOUT_REGISTRY
from verl.workers.rollout.replica import RolloutReplicaRegistry
from verl.utils.tracking import Tracking
print(json.dumps({
    "agent_loop": _agent_loop_registry.get("agentrl"),
    "loss": "agentrl_onpolicy" in POLICY_LOSS_REGISTRY,
    "attention": getattr(AttentionInterface._global_mapping.get("agentrl_sink"), "__qualname__", None),
    "rollout": [_ROLLOUT_REGISTRY.get(("agentrl", "async")), "agentrl" in RolloutReplicaRegistry._registry],
    "tracking": "agentrl" in Tracking.supported_backend,
}))
"""


def _probe(**env: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, env={**os.environ, **env}, timeout=120,
        cwd="/",  # no checkout-relative metadata on sys.path: the installed entry point only
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_verl_registers_agent_loop_loss_and_attention():
    seen = _probe()
    assert seen["agent_loop"] == {"_target_": "agentrl.train.verl_backend.agent_loop.AgentrlAgentLoop"}
    assert seen["loss"] is True
    assert seen["attention"] == "ulysses_attention.<locals>.attention"
    assert seen["rollout"] == ["agentrl.train.verl_backend.rollout.AgentrlRollout", True]
    assert seen["tracking"] is True
    # verl's switch turns the plugin off: the registrations above came from the entry point
    off = _probe(VERL_USE_EXTERNAL_PLUGINS="none")
    assert off == {"agent_loop": None, "loss": False, "attention": None, "rollout": [None, False], "tracking": False}


def test_onpolicy_loss_through_get_policy_loss_fn():
    import torch
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.utils.config import omega_conf_to_dataclass

    import agentrl.train.verl_backend.plugin as plugin
    from agentrl.train.verl_backend.validate import compose_verl_config

    assert plugin.FAILED == {}
    cfg = compose_verl_config(["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                               "actor_rollout_ref.actor.clip_ratio_low=0.2",
                               "actor_rollout_ref.actor.clip_ratio_high=0.28"])
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    torch.manual_seed(0)
    b, t = 4, 7
    log_prob = (torch.randn(b, t) * 0.3 - 1.0).requires_grad_()
    stale_old = log_prob.detach() + torch.randn(b, t) * 0.5  # a recomputed old log-prob that drifted
    adv = torch.randn(b, t)
    mask = (torch.rand(b, t) > 0.2).float()

    ours = get_policy_loss_fn("agentrl_onpolicy")
    loss, metrics = ours(stale_old, log_prob, adv, mask, "token-mean", actor, None)
    # the fix: the ratio is exactly 1, so the loss is verl's vanilla loss at old = log_prob.detach()
    ref_loss, ref_metrics = get_policy_loss_fn("vanilla")(log_prob.detach(), log_prob, adv, mask, "token-mean",
                                                          actor, None)
    drifted, _ = get_policy_loss_fn("vanilla")(stale_old, log_prob, adv, mask, "token-mean", actor, None)
    torch.testing.assert_close(loss, ref_loss)
    assert not torch.allclose(loss, drifted)
    assert metrics["actor/onpolicy_fix"] == 1.0
    (grad,) = torch.autograd.grad(loss, log_prob)
    # d/dlogp of -A * exp(logp - sg(logp)) averaged over mask tokens = -A * mask / n_tokens
    torch.testing.assert_close(grad, -adv * mask / mask.sum())

    with pytest.raises(ValueError, match="ppo_epochs=1"):
        ours(stale_old, log_prob, adv, mask, "token-mean", dataclasses.replace(actor, ppo_epochs=2), None)
