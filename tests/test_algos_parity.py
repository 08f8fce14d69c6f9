"""Parity of agentrl.train.algorithms with verl 0.9.1's reference implementations on random inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agentrl.train import algorithms as A

core_algos = pytest.importorskip(
    "verl.trainer.ppo.core_algos",
    reason="verl is not installed (pip install 'agentrl-sdk[verl]' to run parity tests)",
)
rch = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper", reason="verl is not installed")
from omegaconf import OmegaConf  # noqa: E402  (verl dependency)
from verl.workers.config.actor import ActorConfig  # noqa: E402


def _batch(seed: int, B: int = 12, T: int = 9):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    # interleave env tokens (mask 0) inside responses, as in multi-turn agent trajectories
    mask[:, 2] = mask[:, 2] * (torch.rand(B, generator=g) < 0.5).float()
    mask[0, 0] = 1.0
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lengths - 1] = torch.randn(B, generator=g)
    old = -torch.rand(B, T, generator=g) * 3
    new = old + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    return mask, rewards, old, new, adv, g


def _close(ours: torch.Tensor, theirs: torch.Tensor):
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("norm", [True, False])
def test_grpo(seed, norm):
    mask, rewards, *_ = _batch(seed)
    index = np.array(["a", "a", "a", "b", "b", "c", "d", "d", "d", "d", "e", "e"], dtype=object)
    ours = A.compute_advantages(
        "grpo", token_level_rewards=rewards, response_mask=mask, index=index, norm_adv_by_std_in_grpo=norm
    )
    theirs = core_algos.compute_grpo_outcome_advantage(
        rewards.clone(), mask, index, norm_adv_by_std_in_grpo=norm
    )
    for o, t in zip(ours, theirs, strict=True):
        _close(o, t)


@pytest.mark.parametrize("seed", [0, 1])
def test_group_estimators(seed):
    mask, rewards, *_ = _batch(seed)
    index = np.array([0, 0, 1, 1, 1, 2, 3, 3, 3, 3, 4, 5])
    for name, fn in [
        ("rloo", core_algos.compute_rloo_outcome_advantage),
        ("opo", core_algos.compute_opo_outcome_advantage),
        ("reinforce_plus_plus_baseline", core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage),
    ]:
        ours = A.compute_advantages(name, token_level_rewards=rewards, response_mask=mask, index=index)
        theirs = fn(token_level_rewards=rewards.clone(), response_mask=mask, index=index)
        for o, t in zip(ours, theirs, strict=True):
            _close(o, t)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95)])
def test_gae_and_reinforce_pp(gamma, lam):
    mask, rewards, _, _, _, g = _batch(3)
    values = torch.randn(mask.shape, generator=g)
    ours = A.compute_advantages(
        "gae", token_level_rewards=rewards, response_mask=mask, values=values, gamma=gamma, lam=lam
    )
    theirs = core_algos.compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    for o, t in zip(ours, theirs, strict=True):
        _close(o, t)
    cfg = OmegaConf.create({"gamma": gamma})
    ours = A.compute_advantages(
        "reinforce_plus_plus", token_level_rewards=rewards, response_mask=mask, gamma=gamma
    )
    theirs = core_algos.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config=cfg)
    for o, t in zip(ours, theirs, strict=True):
        _close(o, t)


@pytest.mark.parametrize("mode", A.LOSS_AGG_MODES)
def test_agg_loss(mode):
    mask, _, _, _, adv, _ = _batch(4)
    mask[5] = 0.0  # a fully masked row
    _close(A.agg_loss(adv, mask, mode), core_algos.agg_loss(adv, mask, mode))


@pytest.mark.parametrize("kind", ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "k3+", "k1+"])
def test_kl_penalty(kind):
    _, _, old, new, _, _ = _batch(5)
    a = new.clone().requires_grad_(True)
    b = new.clone().requires_grad_(True)
    ours = A.kl_penalty(a, old, kind)
    theirs = core_algos.kl_penalty(b, old, kind)
    _close(ours, theirs)
    ours.sum().backward()
    theirs.sum().backward()
    _close(a.grad, b.grad)


@pytest.mark.parametrize("name", ["vanilla", "gspo", "cispo"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("clip", [(0.2, None, None), (0.2, 0.1, 0.28)])
@pytest.mark.parametrize("with_is", [False, True])
def test_policy_losses(name, mode, clip, with_is):
    mask, _, old, new, adv, g = _batch(6)
    w = torch.rand(mask.shape, generator=g) * 2 if with_is else None
    ratio, low, high = clip
    cfg = ActorConfig(
        strategy="fsdp",
        ppo_micro_batch_size_per_gpu=1,
        rollout_n=1,
        clip_ratio=ratio,
        clip_ratio_low=ratio if low is None else low,
        clip_ratio_high=ratio if high is None else high,
    )
    a = new.clone().requires_grad_(True)
    b = new.clone().requires_grad_(True)
    ours, om = A.policy_loss(
        name,
        old_log_prob=old,
        log_prob=a,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode=mode,
        clip_ratio=ratio,
        clip_ratio_low=low,
        clip_ratio_high=high,
        rollout_is_weights=w,
    )
    theirs, tm = core_algos.get_policy_loss_fn(name)(old, b, adv, mask, mode, cfg, w)
    _close(ours, theirs)
    ours.backward()
    theirs.backward()
    _close(a.grad, b.grad)
    for k, v in tm.items():
        assert om[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    assert tm["actor/pg_clipfrac"] > 0  # the inputs exercise clipping


def _verl_rollout_corr(old, roll, mask, **kw):
    proto, new_mask, metrics = rch.compute_rollout_correction_and_rejection_mask(old, roll, mask, **kw)
    return (None if proto is None else proto.batch["rollout_is_weights"]), new_mask, metrics


@pytest.mark.parametrize(
    "kw",
    [
        dict(rollout_is="token", rollout_is_threshold=2.0),
        dict(rollout_is="token", rollout_is_threshold=1.3),
        dict(rollout_is="sequence", rollout_is_threshold=5.0),
        dict(rollout_is="token", rollout_is_threshold="0.8_1.25"),
        dict(rollout_is="sequence", rollout_is_threshold="0.5_2.0", rollout_is_batch_normalize=True),
        dict(rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True),
        dict(rollout_rs="token_k1", rollout_rs_threshold="0.8_1.25"),
        dict(rollout_rs="token_k2,token_k3", rollout_rs_threshold="0.02,0.01"),
        dict(rollout_rs="seq_sum_k1,seq_mean_k3,seq_max_k2", rollout_rs_threshold="2.0,0.01,0.05"),
        dict(rollout_rs="seq_mean_k1,seq_sum_k2,seq_max_k3,seq_mean_k2,seq_sum_k3", rollout_rs_threshold=1.1),
        dict(
            rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01
        ),
        dict(),
    ],
)
def test_rollout_correction(kw):
    mask, _, old, _, _, g = _batch(7, B=16, T=12)
    roll = old + 0.15 * torch.randn(old.shape, generator=g)
    w, m, met = A.rollout_correction(old_log_prob=old, rollout_log_prob=roll, response_mask=mask, **kw)
    tw, tm_mask, tmet = _verl_rollout_corr(old, roll, mask, **kw)
    assert (w is None) == (tw is None)
    if w is not None:
        _close(w, tw)
    assert torch.equal(m, tm_mask)
    assert m.dtype == mask.dtype
    assert set(tmet) <= set(met), sorted(set(tmet) - set(met))
    for k, v in tmet.items():
        assert met[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    extra = set(met) - set(tmet)
    assert extra == {"rollout_corr/logprob_abs_diff_mean", "rollout_corr/logprob_abs_diff_max"}
    diff = (old - roll).abs()[mask.bool()]
    assert met["rollout_corr/logprob_abs_diff_max"] == pytest.approx(diff.max().item())
    if "rollout_rs" in kw:
        assert 0 < met["rollout_corr/rollout_rs_masked_fraction"] < 1  # the thresholds really reject some


def test_onpolicy_loss_registered_in_verl():
    from agentrl.train.verl_backend.losses import ONPOLICY_LOSS_NAME, register_all

    names = register_all()
    assert names[0] == ONPOLICY_LOSS_NAME and {"agentrl_onpolicy_gspo", "agentrl_onpolicy_cispo"} <= set(names)
    fn = core_algos.get_policy_loss_fn(ONPOLICY_LOSS_NAME)
    mask, _, old, new, adv, _ = _batch(8)
    cfg = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1, clip_ratio=0.2)
    a = new.clone().requires_grad_(True)
    loss, metrics = fn(old, a, adv, mask, "token-mean", cfg, None)
    assert metrics["actor/pg_clipfrac"] == 0.0 and metrics["actor/ppo_kl"] == 0.0
    assert metrics["actor/onpolicy_fix"] == 1.0
    loss.backward()
    # with ratio == 1 the clipped loss is the plain policy gradient -A * grad(log pi), token-mean
    _close(a.grad, -adv * mask / mask.sum())
    # vanilla with a stale old_log_prob clips and gives a different gradient
    _, vm = core_algos.get_policy_loss_fn("vanilla")(old, new, adv, mask, "token-mean", cfg, None)
    assert vm["actor/pg_clipfrac"] > 0
    bad = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1, ppo_epochs=2)
    from agentrl.train.verl_backend.losses import StaleOldLogProbError

    with pytest.raises(StaleOldLogProbError, match="ppo_epochs=1"):
        fn(old, a, adv, mask, "token-mean", bad, None)
