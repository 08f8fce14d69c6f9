"""The agentrl verl plugin: loaded by `import verl` through the entry point; our policy loss through verl."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("verl")
pytestmark = pytest.mark.verl  # runs verl's own code: the verl tier

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
    "loss": "agentrl_onpolicy" in POLICY_LOSS_REGISTRY and "agentrl_onpolicy_gspo" in POLICY_LOSS_REGISTRY,
    "guard": getattr(__import__("verl.utils.tensordict_utils").utils.tensordict_utils.make_iterator,
                     "_agentrl_guard", False),
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
    assert seen["loss"] is True and seen["guard"] is True
    assert seen["attention"] == "ulysses_attention.<locals>.attention"
    assert seen["rollout"] == ["agentrl.train.verl_backend.rollout.AgentrlRollout", True]
    assert seen["tracking"] is True
    # verl's switch turns the plugin off: the registrations above came from the entry point
    off = _probe(VERL_USE_EXTERNAL_PLUGINS="none")
    assert off == {"agent_loop": None, "loss": False, "guard": False, "attention": None, "rollout": [None, False],
                   "tracking": False}


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

    from agentrl.train.verl_backend.losses import StaleOldLogProbError

    with pytest.raises(StaleOldLogProbError, match="ppo_epochs=1"):
        ours(stale_old, log_prob, adv, mask, "token-mean", dataclasses.replace(actor, ppo_epochs=2), None)


# ---------------------------------------------------------------------------- the fix inside verl's loss
BASES = ["vanilla", "gspo", "cispo", "sapo", "geo_mean", "dppo_tv", "gpg"]
MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _actor(**kw):
    from verl.workers.config.actor import ActorConfig

    return ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1, clip_ratio_low=0.2,
                       clip_ratio_high=0.28, **kw)


def _inputs(b=8, t=7, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    log_prob = -torch.rand(b, t, generator=g) * 3
    stale = log_prob + torch.randn(b, t, generator=g) * 0.5  # a recomputed old log-prob that drifted
    adv = torch.randn(b, t, generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.3).float()
    mask[0] = 0.0  # a row without tokens
    weights = torch.rand(b, t, generator=g) * 2
    return log_prob, stale, adv, mask, weights


def _info(mask, dp):
    return {"dp_size": dp, "batch_num_tokens": float(mask.sum()) * dp,
            "global_batch_size": float((mask.sum(-1) > 0).sum()) * dp, "loss_scale_factor": 5}


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_onpolicy_loss_is_verls_loss_at_detached_old(base, mode, dp):
    """agentrl_onpolicy[_<base>] with verl's full global_batch_info (dp_size, loss_scale_factor, ...) equals
    verl's <base> at old_log_prob = log_prob.detach(), in value, gradient and metrics."""
    import torch
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    import agentrl.train.verl_backend.plugin  # noqa: F401  (registers the losses)
    from agentrl.train.verl_backend.config_map import onpolicy_loss_name

    log_prob, stale, adv, mask, weights = _inputs()
    actor = _actor(global_batch_info=_info(mask, dp), loss_scale_factor=5)
    a = log_prob.clone().requires_grad_(True)
    b = log_prob.clone().requires_grad_(True)
    ours, om = get_policy_loss_fn(onpolicy_loss_name(base))(stale, a, adv, mask, mode, actor, weights)
    ref, rm = get_policy_loss_fn(base)(b.detach(), b, adv, mask, mode, actor, weights)
    assert torch.equal(ours, ref)
    ours.backward()
    ref.backward()
    assert torch.equal(a.grad, b.grad) and a.grad.abs().sum() > 0
    assert {k: v for k, v in om.items() if not k.startswith("actor/onpolicy_")} == rm
    assert om["actor/onpolicy_fix"] == 1.0
    assert om["actor/onpolicy_recompute_gap_max"] == pytest.approx(((stale - log_prob).abs() * mask).max().item())


@pytest.mark.parametrize("mode", MODES)
def test_onpolicy_loss_with_dp_size_4_gives_the_single_process_gradient(mode):
    """Four data-parallel ranks, each with a quarter of the rows and verl's global_batch_info: FSDP's gradient
    average equals the gradient of verl's vanilla loss over the whole batch on one process. The old
    agentrl_onpolicy ignored dp_size and was 4x too small here."""
    import torch
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    import agentrl.train.verl_backend.plugin  # noqa: F401

    log_prob, stale, adv, mask, _ = _inputs(b=12)
    mask[5] = 0.0
    full = log_prob.clone().requires_grad_(True)
    ref, _ = get_policy_loss_fn("vanilla")(full.detach(), full, adv, mask, mode, _actor(), None)
    ref.backward()
    shards = torch.arange(12).chunk(4)
    info = {"dp_size": 4, "batch_num_tokens": float(mask.sum()), "global_batch_size": float((mask.sum(-1) > 0).sum()),
            "loss_scale_factor": None}
    averaged = torch.zeros_like(log_prob)
    ignored_dp = torch.zeros_like(log_prob)
    for rows in shards:
        part = log_prob[rows].clone().requires_grad_(True)
        loss, _ = get_policy_loss_fn("agentrl_onpolicy")(stale[rows], part, adv[rows], mask[rows], mode,
                                                       _actor(global_batch_info=dict(info)), None)
        (grad,) = torch.autograd.grad(loss, part)
        averaged[rows] += grad / 4  # FSDP/DDP average over the data-parallel group
        part = log_prob[rows].clone().requires_grad_(True)
        loss, _ = get_policy_loss_fn("vanilla")(part.detach(), part, adv[rows], mask[rows], mode,
                                              _actor(global_batch_info={**info, "dp_size": 1}), None)
        (grad,) = torch.autograd.grad(loss, part)
        ignored_dp[rows] += grad / 4
    torch.testing.assert_close(averaged, full.grad, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(ignored_dp * 4, full.grad, rtol=1e-6, atol=1e-8)  # what ignoring dp_size gave


def _run_verl_update(n_rows: int, mini_batch_size: int, epochs: int = 1):
    """verl's own ``TrainingWorker.train_mini_batch`` loop (undecorated, on a stand-in engine) training a
    log-prob table with the agentrl_onpolicy loss; returns the optimizer steps taken."""
    import inspect
    from contextlib import contextmanager
    from types import SimpleNamespace

    import torch
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine_workers import TrainingWorker

    import agentrl.train.verl_backend.plugin  # noqa: F401  (the update guard)

    theta = torch.zeros(n_rows, 3, requires_grad=True)
    opt = torch.optim.SGD([theta], lr=0.1)
    loss_fn = get_policy_loss_fn("agentrl_onpolicy")
    taken = []

    class Engine:
        def get_data_parallel_size(self):
            return 1

        def get_data_parallel_rank(self):
            return 0

        @contextmanager
        def train_mode(self, **_):
            yield

        def is_mp_src_rank_with_outputs(self):
            return False

    def train_batch(mini):
        rows = mini["row"]
        log_prob = torch.log_softmax(theta[rows], dim=-1)
        loss, _ = loss_fn(mini["old_log_probs"], log_prob, mini["advantages"], mini["response_mask"], "token-mean",
                          _actor(), None)
        opt.zero_grad()
        loss.backward()
        opt.step()
        taken.append(len(rows))

    worker = SimpleNamespace(engine=Engine(), profiler=SimpleNamespace(step=lambda: None), train_batch=train_batch)
    with torch.no_grad():
        old = torch.log_softmax(theta, dim=-1)
    data = tu.get_tensordict(
        {"row": torch.arange(n_rows), "old_log_probs": old, "advantages": torch.randn(n_rows, 3),
         "response_mask": torch.ones(n_rows, 3)},
        non_tensor_dict={"mini_batch_size": mini_batch_size, "epochs": epochs},
    )
    inspect.unwrap(TrainingWorker.train_mini_batch)(worker, data)
    return taken


def test_stale_old_log_prob_is_detected_inside_verls_update_loop():
    from agentrl.train.verl_backend.losses import StaleOldLogProbError

    assert _run_verl_update(8, mini_batch_size=8) == [8]  # one step: trained with the fix
    with pytest.raises(StaleOldLogProbError, match="2 optimizer steps") as err:
        _run_verl_update(8, mini_batch_size=4)  # the second mini-batch would use a stale old_log_prob
    assert "Nothing was trained" in str(err.value)
    with pytest.raises(StaleOldLogProbError, match="2 optimizer steps"):
        _run_verl_update(8, mini_batch_size=8, epochs=2)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_verl_onpolicy_loss_on_4_dp_ranks_gives_the_embedded_update_gradient(mode):
    """A tiny model's batch split over 4 data-parallel ranks, each running verl's agentrl_onpolicy loss with
    verl's global_batch_info (dp_size=4): the rank-averaged parameter gradient equals the gradient of one
    embedded `run_update` step on the whole batch (on-policy, same advantages)."""
    import torch
    from _tiny_llama import tiny_llama
    from _tiny_update import ragged_batch
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    import agentrl.train.verl_backend.plugin  # noqa: F401
    from agentrl.train.algorithms import compute_advantages
    from agentrl.train.config import build_config
    from agentrl.train.update import forward_logprobs, run_update

    batch = ragged_batch(8)
    model = tiny_llama()
    cfg = build_config(["env=retool", "actor.grad_clip=1e9", f"actor.loss_agg_mode={mode}", "actor.micro_batch_size=3"])
    m = run_update(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), batch=batch, cfg=cfg,
                   temperature=1.0).metrics
    assert m["actor/on_policy"] == 1.0
    embedded = {k: p.grad.clone() for k, p in model.named_parameters()}

    model.zero_grad()
    adv, _ = compute_advantages("grpo", token_level_rewards=batch.token_level_rewards,
                                response_mask=batch.response_mask, index=batch.index)
    mask = batch.response_mask
    info = {"dp_size": 4, "batch_num_tokens": float(mask.sum()), "global_batch_size": float((mask.sum(-1) > 0).sum()),
            "loss_scale_factor": None}
    accumulated = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
    for rows in torch.arange(len(batch)).chunk(4):
        model.zero_grad()
        shard = batch.select(rows)
        log_prob, _ = forward_logprobs(model, shard, chunk_size=1024, temperature=1.0, compute_entropy=False)
        stale = log_prob.detach() + 0.3  # what verl's separate pass would hand over; the fix ignores it
        loss, _ = get_policy_loss_fn("agentrl_onpolicy")(stale, log_prob, adv[rows], mask[rows], mode,
                                                       _actor(global_batch_info=dict(info)), None)
        loss.backward()
        for k, p in model.named_parameters():
            accumulated[k] += p.grad / 4  # FSDP's average over the data-parallel group
    for k, g in embedded.items():
        torch.testing.assert_close(accumulated[k], g, rtol=1e-5, atol=1e-8)


_UNFINISHED_UPDATE = r"""
import torch
from tensordict import TensorDict
import verl  # loads the agentrl plugin, which installs the update guard
from verl.utils import tensordict_utils
from agentrl.train.verl_backend.losses import current_update_steps

td = TensorDict({"x": torch.arange(8)}, batch_size=[8])
old = tensordict_utils.make_iterator(td, 2, 1)
next(old)  # an update that stopped after its first mini-batch (e.g. it raised)
new = tensordict_utils.make_iterator(td, 8, 1)
next(new)
old.close()  # closing the abandoned one must not clear the running update's count
assert current_update_steps() == 1, current_update_steps()
stuck = tensordict_utils.make_iterator(td, 2, 1)
next(stuck)
torch._agentrl_test_keep = stuck  # held by a module finalized after the guard's: collected at interpreter exit
print("ok")
"""


def test_an_unfinished_update_iterator_is_finalized_quietly_at_interpreter_exit():
    out = subprocess.run([sys.executable, "-c", _UNFINISHED_UPDATE], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))})
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
    assert "Exception ignored" not in out.stderr and "TypeError" not in out.stderr, out.stderr[-2000:]
