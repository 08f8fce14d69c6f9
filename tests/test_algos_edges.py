"""Property tests for the numerical edges listed below, against verl 0.9.1's functions on random inputs.

- fp16 / bf16 inputs: every advantage estimator, aggregation mode, KL estimator, policy loss and
  rollout-correction mode computes in fp32. Asserted: the result (and the gradient) is bit for bit the
  fp32 computation on the upcast values, returned in fp32, and equal to verl's functions on those fp32
  values (what verl's pipeline holds) within the bounds of ``tests/test_algos_properties.py``.
- ``epsilon=0`` (GRPO): no NaN; a constant group gets exactly 0 (verl: 0 / 0); every other row equals
  verl's with ``epsilon=0``; a negative epsilon is refused (function and config).
- statistics over no token: an all-zero mask aggregates to exactly 0 with a zero gradient (verl: NaN),
  and the policy loss leaves its ratio statistics out (they were ``±inf`` and 0); verl's own metrics stay
  verl's values.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_algos_properties import (
    GROUP_ESTIMATORS,
    KL_KINDS,
    _check_agg,
    _check_correction,
    _check_group_estimator,
    _check_kl,
    _check_policy_loss,
    _check_token_estimators,
    batch_info,
    correction_modes,
    group_cases,
    logprob_cases,
    token_reward_cases,
    with_junk,
)

from agentrl.train import algorithms as A
from agentrl.train.config import ConfigError, build_config

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl is not installed")

HALF = (torch.float16, torch.bfloat16)
HALF_MAX = {torch.float16: 6e4, torch.bfloat16: 3e38}


def _half(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


def _upcast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The fp32 values a half tensor holds (what the promoted computation sees)."""
    return None if t is None else t.to(dtype).float()


# ---------------------------------------------------------------------------- half precision: advantages
def _half_group_case(case: dict, dtype: torch.dtype) -> dict:
    """``case`` (fp32) with its scores rounded to ``dtype`` and kept in fp32: the values a half input holds."""
    scores = case["scores"].clamp(-HALF_MAX[dtype], HALF_MAX[dtype]).to(dtype).float()
    rewards = torch.zeros_like(case["rewards"])
    rewards[:, 0] = scores  # outcome estimators see the row sum only
    return {**case, "scores": scores, "rewards": rewards}


def _check_half_group(case, name, norm, dtype):
    up = _half_group_case(case, dtype)
    kw = {"norm_adv_by_std_in_grpo": norm} if name == "grpo" else {}
    ours, ret = A.compute_advantages(name, token_level_rewards=up["rewards"].to(dtype),
                                     response_mask=up["mask"].to(dtype), index=up["index"], **kw)
    fp32, _ = A.compute_advantages(name, token_level_rewards=up["rewards"], response_mask=up["mask"],
                                   index=up["index"], **kw)
    assert ours.dtype == torch.float32 and torch.equal(ours, fp32) and torch.equal(ours, ret)
    _check_group_estimator(name, up, norm)  # the fp32 computation against verl (fp32 and fp64)


HALF_GROUP_INPUTS = given(case=group_cases(), name=st.sampled_from(GROUP_ESTIMATORS), norm=st.booleans(),
                          dtype=st.sampled_from(HALF))


@HALF_GROUP_INPUTS
def test_group_estimators_promote_half_inputs(case, name, norm, dtype):
    _check_half_group(case, name, norm, dtype)



def test_fp16_grpo_of_large_scores_is_the_fp64_value():
    """Scores near 300 (steps of 0.25 in fp16): fp16 accumulation overflowed the sum of squares and gave
    advantages far off; promoted, they are the fp64 values of the same fp16 inputs to fp32 rounding."""
    g = torch.Generator().manual_seed(0)
    scores = (300 + 40 * torch.randn(16, generator=g)).to(torch.float16)
    rewards = torch.zeros(16, 5, dtype=torch.float16)
    rewards[:, -1] = scores
    index = np.repeat(np.arange(2), 8)
    ours, _ = A.compute_advantages("grpo", token_level_rewards=rewards, response_mask=torch.ones(16, 5, dtype=torch.float16),
                                   index=index)
    ref, _ = core_algos.compute_grpo_outcome_advantage(rewards.double(), torch.ones(16, 5, dtype=torch.float64), index)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5)


def _check_half_token_estimators(case, dtype):
    mask = case["mask"]
    rewards, values = (_upcast(t, dtype) for t in (case["rewards"], case["values"]))
    for name, extra in (("gae", {"values": values, "lam": case["lam"]}), ("reinforce_plus_plus", {})):
        half_extra = {k: (_half(v, dtype) if isinstance(v, torch.Tensor) else v) for k, v in extra.items()}
        ours = A.compute_advantages(name, token_level_rewards=rewards.to(dtype), response_mask=mask.to(dtype),
                                    gamma=case["gamma"], **half_extra)
        fp32 = A.compute_advantages(name, token_level_rewards=rewards, response_mask=mask, gamma=case["gamma"], **extra)
        for o, f in zip(ours, fp32, strict=True):
            assert o.dtype == torch.float32 and torch.equal(o, f)
    _check_token_estimators({**case, "rewards": rewards, "values": values})  # fp32 against verl


@given(case=token_reward_cases(), dtype=st.sampled_from(HALF))
def test_token_estimators_promote_half_inputs(case, dtype):
    _check_half_token_estimators(case, dtype)


# ---------------------------------------------------------------------------- half precision: losses
def _half_logprob_case(case: dict, dtype: torch.dtype) -> dict:
    """``case`` with log-probs and advantages rounded to ``dtype`` (kept fp32; a 1e4-nat gap stays one)."""
    return {**case, **{k: _upcast(case[k], dtype) for k in ("old", "other", "adv")}}


def _check_half_agg(case, mode, info, dtype):
    up = _half_logprob_case(case, dtype)
    mask = up["mask"]
    loss_mat = up["adv"] * torch.exp(up["other"].clamp(-20, 20) - up["old"])
    half_mat = loss_mat.clamp(-HALF_MAX[dtype], HALF_MAX[dtype]).to(dtype).requires_grad_(True)
    ours = A.agg_loss(half_mat, mask.to(dtype), mode, **info)
    ref_mat = half_mat.detach().float().requires_grad_(True)
    fp32 = A.agg_loss(ref_mat, mask, mode, **info)
    assert ours.dtype == torch.float32 and torch.equal(ours, fp32)
    ours.backward()
    fp32.backward()
    assert half_mat.grad.dtype == dtype and torch.equal(half_mat.grad, ref_mat.grad.to(dtype))
    _check_agg({**up, "adv": half_mat.detach().float(), "other": up["old"]}, mode, info)  # fp32 against verl


@given(data=st.data(), mode=st.sampled_from(A.LOSS_AGG_MODES), dtype=st.sampled_from(HALF))
def test_agg_loss_promotes_half_inputs(data, mode, dtype):
    case = data.draw(logprob_cases())
    _check_half_agg(case, mode, data.draw(batch_info(case["mask"])), dtype)


def _check_half_kl(case, kind, dtype):
    up = _half_logprob_case(case, dtype)
    a = up["other"].to(dtype).requires_grad_(True)
    b = up["other"].clone().requires_grad_(True)
    ours = A.kl_penalty(a, up["old"].to(dtype), kind)
    fp32 = A.kl_penalty(b, up["old"], kind)
    assert ours.dtype == torch.float32 and torch.equal(ours, fp32)
    (ours * up["mask"]).sum().backward()
    (fp32 * up["mask"]).sum().backward()
    assert torch.equal(a.grad, b.grad.to(dtype))
    _check_kl(up, kind)  # fp32 against verl


@given(case=logprob_cases(need_token=False), kind=st.sampled_from(KL_KINDS), dtype=st.sampled_from(HALF))
def test_kl_penalty_promotes_half_inputs(case, kind, dtype):
    _check_half_kl(case, kind, dtype)


def _check_half_policy_loss(case, name, mode, with_is, info, dtype):
    up = _half_logprob_case(case, dtype)
    mask, g, junk = up["mask"], up["g"], up["junk"]
    weights = _upcast(torch.rand(mask.shape, generator=g) * 2, dtype) if with_is else None
    inputs = {k: with_junk(up[k], mask, junk, g) for k in ("old", "other", "adv")}
    a = inputs["other"].to(dtype).requires_grad_(True)
    b = inputs["other"].clone().requires_grad_(True)
    common = dict(response_mask=mask, loss_agg_mode=mode, **info)
    ours, om = A.policy_loss(name, old_log_prob=inputs["old"].to(dtype), log_prob=a, advantages=inputs["adv"].to(dtype),
                             rollout_is_weights=_half(weights, dtype), **{**common, "response_mask": mask.to(dtype)})
    fp32, fm = A.policy_loss(name, old_log_prob=inputs["old"], log_prob=b, advantages=inputs["adv"],
                             rollout_is_weights=weights, **common)
    assert ours.dtype == torch.float32 and torch.equal(ours, fp32) and om == fm
    ours.backward()
    fp32.backward()
    assert torch.isfinite(a.grad).all() and torch.equal(a.grad, b.grad.to(dtype))
    # fp32 against verl (the check draws its IS weights from the generator again: same distribution)
    _check_policy_loss(up, name, mode, (0.2, None, None, 3.0), with_is, info)


@given(data=st.data(), name=st.sampled_from(sorted(A.POLICY_LOSSES)), mode=st.sampled_from(A.LOSS_AGG_MODES),
       with_is=st.booleans(), dtype=st.sampled_from(HALF))
def test_policy_losses_promote_half_inputs(data, name, mode, with_is, dtype):
    case = data.draw(logprob_cases(need_token=True))
    _check_half_policy_loss(case, name, mode, with_is, data.draw(batch_info(case["mask"])), dtype)


def _check_half_correction(case, kw, dtype):
    up = _half_logprob_case(case, dtype)
    mask, g, junk = up["mask"], up["g"], up["junk"]
    old, roll = with_junk(up["old"], mask, junk, g), with_junk(up["other"], mask, junk, g)
    w, m, met = A.rollout_correction(old_log_prob=old.to(dtype), rollout_log_prob=roll.to(dtype),
                                     response_mask=mask.to(dtype), **kw)
    w32, m32, met32 = A.rollout_correction(old_log_prob=old, rollout_log_prob=roll, response_mask=mask, **kw)
    assert m.dtype == dtype and torch.equal(m.float(), m32)
    assert (w is None and w32 is None) or (w.dtype == torch.float32 and torch.equal(w, w32))
    assert met.keys() == met32.keys()
    for k, v in met32.items():
        assert met[k] == v or (np.isnan(met[k]) and np.isnan(v)), k
    _check_correction(up, kw)  # fp32 against verl


@given(case=logprob_cases(need_token=True), kw=correction_modes(), dtype=st.sampled_from(HALF))
def test_rollout_correction_promotes_half_inputs(case, kw, dtype):
    _check_half_correction(case, kw, dtype)


# ---------------------------------------------------------------------------- epsilon = 0
@given(case=st.sampled_from([torch.float32, torch.float64]).flatmap(lambda d: group_cases(dtype=d)))
def test_grpo_with_epsilon_zero_matches_verl_and_keeps_constant_groups_at_zero(case):
    _check_group_estimator("grpo", case, norm=True, epsilon=0.0)



@pytest.mark.parametrize("tiny", [1e-30, 1e-25, 3e-20])
def test_grpo_std_of_tiny_differences_does_not_underflow(tiny):
    """Differences whose squares underflow fp32: verl's fp32 std is 0 and epsilon=0 gives inf/NaN; ours is
    the fp64 value."""
    rewards = torch.tensor([[tiny], [2 * tiny], [0.0], [5.0], [5.0]])
    mask, index = torch.ones(5, 1), np.array([0, 0, 0, 1, 1])
    ours, _ = A.compute_advantages("grpo", token_level_rewards=rewards, response_mask=mask, index=index, epsilon=0.0)
    ref, _ = core_algos.compute_grpo_outcome_advantage(rewards.double(), mask.double(), index, epsilon=0.0)
    assert torch.isfinite(ours).all() and (ours[3:] == 0).all()
    torch.testing.assert_close(ours[:3].double(), ref[:3], rtol=1e-5, atol=0)
    theirs, _ = core_algos.compute_grpo_outcome_advantage(rewards.clone(), mask, index, epsilon=0.0)
    assert not torch.isfinite(theirs).all()


@pytest.mark.parametrize("epsilon", [-1e-6, float("nan")])
def test_negative_or_nan_epsilon_is_refused(epsilon):
    rewards = torch.zeros(2, 2)
    rewards[0, 1] = 1.0
    with pytest.raises(ValueError, match="epsilon must be >= 0"):
        A.compute_advantages("grpo", token_level_rewards=rewards, response_mask=torch.ones(2, 2), index=[0, 0],
                             epsilon=epsilon)
    with pytest.raises(ConfigError, match="algorithm.epsilon must be (>= 0|a finite number)"):
        build_config(["env=retool", f"algorithm.epsilon={epsilon}"])


# ---------------------------------------------------------------------------- statistics over no token
@given(data=st.data(), mode=st.sampled_from(A.LOSS_AGG_MODES), name=st.sampled_from(sorted(A.POLICY_LOSSES)))
def test_an_empty_mask_gives_a_zero_loss_and_no_ratio_statistics(data, mode, name):
    case = data.draw(logprob_cases(need_token=False))
    empty = torch.zeros_like(case["mask"])
    a = case["other"].clone().requires_grad_(True)
    loss = A.agg_loss(a * case["adv"], empty, mode)
    loss.backward()
    assert loss.item() == 0.0 and (a.grad == 0).all()
    verl_loss = core_algos.agg_loss(case["adv"], empty, mode)
    assert mode == "token-sum" or torch.isnan(verl_loss)  # verl divides 0 by 0
    b = case["other"].clone().requires_grad_(True)
    ours, om = A.policy_loss(name, old_log_prob=case["old"], log_prob=b, advantages=case["adv"],
                             response_mask=empty, loss_agg_mode=mode)
    ours.backward()
    assert ours.item() == 0.0 and (b.grad == 0).all()
    assert not any(k.startswith("actor/ppo_ratio") for k in om)
    from verl.workers.config.actor import ActorConfig

    cfg = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1)
    _, tm = core_algos.get_policy_loss_fn(name)(case["old"], case["other"], case["adv"], empty, mode, cfg, None)
    assert {k: om[k] for k in tm} == pytest.approx(tm)  # verl's keys keep verl's values (0)
