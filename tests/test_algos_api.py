"""agentrl.train.algorithms without verl: hand-computed values, edge cases and error messages."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from agentrl.train import algorithms as A


def test_grpo_and_rloo_hand_values():
    rewards = torch.zeros(4, 3)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 5.0])
    mask = torch.ones(4, 3)
    mask[1, 2] = 0
    index = [
        "p",
        "p",
        "p",
        "q",
    ]  # group p: scores 1, 0 (reward on a masked token still counts), 1; q: singleton
    adv, ret = A.compute_advantages("grpo", token_level_rewards=rewards, response_mask=mask, index=index)
    std = torch.tensor([1.0, 0.0, 1.0]).std().item()
    mean = 2 / 3
    assert adv[0, 0].item() == pytest.approx((1 - mean) / (std + 1e-6))
    assert adv[1, 2].item() == 0.0  # masked token
    assert adv[3, 0].item() == pytest.approx(5.0 / (1 + 1e-6))  # singleton: mean 0, std 1
    assert torch.equal(adv, ret)
    adv, _ = A.compute_advantages(
        "rloo", token_level_rewards=rewards, response_mask=mask, index=np.array(index)
    )
    assert adv[0, 0].item() == pytest.approx(1 - 0.5)  # minus mean of the others (0, 1)
    assert adv[1, 0].item() == pytest.approx(0 - 1.0)
    assert adv[3, 0].item() == 5.0


def test_gae_skips_env_tokens():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 0.25]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])  # the middle token is an env token: its value is ignored
    _, ret = A.compute_advantages(
        "gae", token_level_rewards=rewards, response_mask=mask, values=values, gamma=1.0, lam=1.0
    )
    assert ret[0, 2].item() == pytest.approx(1.0)
    assert ret[0, 0].item() == pytest.approx(1.0)  # reward flows back across the env token


def test_vanilla_loss_clips_and_dual_clips():
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1, 5.0]]))
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    mask = torch.ones(1, 4)
    loss, m = A.policy_loss(
        "vanilla",
        old_log_prob=old,
        log_prob=new,
        advantages=adv,
        response_mask=mask,
        clip_ratio=0.2,
        clip_ratio_c=3.0,
    )
    # token losses: -1*min(1.5, 1.2)=-1.2 ; -(-1)*max(0.5, 0.8)=0.8 ; -1.1 ; dual clip: min(3, 5)=3
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 1.1 + 3.0) / 4)
    # the PPO clip binds on tokens 0 and 1; token 3 (A<0, ratio 5) is bounded by the dual clip instead
    assert m["actor/pg_clipfrac"] == pytest.approx(0.5)
    assert m["actor/pg_clipfrac_lower"] == pytest.approx(0.25)
    assert m["actor/ppo_ratio_max"] == pytest.approx(5.0) and m["actor/ppo_ratio_min"] == pytest.approx(0.5)


def test_rollout_correction_tis_icepop_and_rs():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    roll = torch.log(torch.tensor([[0.1, 0.5, 0.45], [0.5, 0.5, 0.5]]))  # ratios 5, 1, 1.11
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    correct = functools.partial(A.rollout_correction, old_log_prob=old, rollout_log_prob=roll, response_mask=mask)
    w, new_mask, m = correct(rollout_is="token", rollout_is_threshold=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0, 0.5 / 0.45], [1.0, 1.0, 0.0]]))
    assert torch.equal(new_mask, mask)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)
    assert m["rollout_corr/logprob_abs_diff_max"] == pytest.approx(math.log(5))
    w, _, _ = correct(rollout_is="token", rollout_is_threshold="0.5_2.0")
    assert w[0, 0].item() == 0.0 and w[0, 2].item() == pytest.approx(0.5 / 0.45)
    _, new_mask, m = correct(rollout_rs="token_k3", rollout_rs_threshold=0.5)
    assert new_mask.tolist() == [[0, 1, 1], [1, 1, 0]]
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 5)
    w, new_mask, m = A.rollout_correction(old_log_prob=old, rollout_log_prob=roll, response_mask=mask)
    assert w is None and torch.equal(new_mask, mask) and "rollout_corr/k3_kl" in m


def _loss(name, old_log_prob):
    """Policy loss ``name`` of one row of one zero log-prob against ``old_log_prob``."""
    return A.policy_loss(name, old_log_prob=old_log_prob, log_prob=torch.zeros(1, 1), advantages=torch.zeros(1, 1),
                         response_mask=torch.ones(1, 1))


def _correction(mask=None, **options):
    """Rollout correction on one row of two zero log-probs (``mask``: all ones by default) with ``options``."""
    mask = torch.ones(1, 2) if mask is None else mask
    return A.rollout_correction(old_log_prob=torch.zeros(1, 2), rollout_log_prob=torch.zeros(1, 2),
                                response_mask=mask, **options)


@pytest.mark.parametrize(
    "call,match",
    [
        (
            lambda: A.compute_advantages(
                "ppo", token_level_rewards=torch.zeros(1, 1), response_mask=torch.ones(1, 1)
            ),
            "choose one of",
        ),
        (
            lambda: A.compute_advantages(
                "grpo", token_level_rewards=torch.zeros(2, 1), response_mask=torch.ones(2, 1)
            ),
            "index=",
        ),
        (
            lambda: A.compute_advantages(
                "grpo", token_level_rewards=torch.zeros(2, 1), response_mask=torch.ones(2, 1), index=[0]
            ),
            "one group id per row",
        ),
        (
            lambda: A.compute_advantages(
                "gae", token_level_rewards=torch.zeros(2, 2), response_mask=torch.ones(2, 2)
            ),
            "values=",
        ),
        (lambda: _loss("ppo2", torch.zeros(1, 1)), "choose one of"),
        (lambda: _loss("vanilla", torch.zeros(1, 2)), "share one"),
        (lambda: A.agg_loss(torch.zeros(1, 1), torch.ones(1, 1), "mean"), "token-mean"),
        (lambda: A.kl_penalty(torch.zeros(1), torch.zeros(1), "k4"), "low_var_kl"),
        (lambda: _correction(torch.zeros(1, 2)), "no model tokens"),
        (lambda: _correction(rollout_is="tok"), "'token', 'sequence'"),
        (lambda: _correction(rollout_is="token", rollout_is_threshold="2_1"), "lo <= hi"),
        (lambda: _correction(rollout_rs="token_k9", rollout_rs_threshold=1), "unknown rollout_rs option"),
        (lambda: _correction(rollout_rs="token_k2"), "is required"),
        (
            lambda: A.agg_loss(torch.ones(1, 2), torch.ones(1, 2), "seq-mean-token-sum-norm", loss_scale_factor=0),
            "loss_scale_factor must be > 0",
        ),
    ],
)
def test_errors_say_what_to_do(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()
