"""Property tests: every advantage estimator, aggregation mode, KL estimator, policy loss and rollout-
correction mode of ``agentrl.train.algorithms`` against verl 0.9.1's own functions, on random inputs.

Inputs (hypothesis): batch 1..17, width 1..12, ragged masks with all-zero, single-token, prefix, holed and
full rows; groups of size 1..B (singletons, constant groups, near-constant groups, binary rewards, scales
1e-6..1e6); log-prob gaps 0..1e4 plus single extreme tokens; NaN/±inf junk outside the masks.

What is asserted:
- equality with verl to fp32 rounding where verl's answer is exact. For the group estimators "rounding" is
  the error bound of a mean of the group's scores, which verl's plain mean exceeds on near-constant groups;
  there we assert the tighter bound against an fp64 run of verl and the looser one against verl in fp32;
- the stricter behaviour where verl's is an artefact: advantage exactly 0 for constant groups (fp32 and
  fp64, sizes 2..64, any value, std normalisation on or off); finite results and zero gradients for junk
  outside masks (verl turns it into NaN); zeros where verl raises on fewer than 2 whitening tokens; finite
  rollout-correction weights for any gap, and ``inf`` metrics exactly where verl reports ``inf``.

CI runs the ``ci`` hypothesis profile (deterministic examples); ``HYPOTHESIS_PROFILE=nightly`` a larger random
sweep (``tests/_profiles.py``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from agentrl.train import algorithms as A

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl is not installed")
rch = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper", reason="verl is not installed")
from omegaconf import OmegaConf  # noqa: E402  (verl dependency)
from verl.workers.config.actor import ActorConfig  # noqa: E402

EPS32 = float(torch.finfo(torch.float32).eps)
EPS64 = float(torch.finfo(torch.float64).eps)
JUNK = (0.0, float("nan"), float("inf"), float("-inf"), "mixed")
GAPS = (0.0, 1e-3, 0.1, 1.0, 30.0, 1e4)


# ---------------------------------------------------------------------------- strategies
@st.composite
def masks(draw, need_token: bool = False):
    """A ragged ``[B, T]`` float mask and a seeded generator for the values."""
    b, t = draw(st.integers(1, 17)), draw(st.integers(1, 12))
    kinds = draw(st.lists(st.sampled_from(["empty", "single", "prefix", "holes", "full"]), min_size=b, max_size=b))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    mask = torch.zeros(b, t)
    for i, kind in enumerate(kinds):
        if kind == "single":
            mask[i, int(torch.randint(t, (1,), generator=g))] = 1
        elif kind == "prefix":
            mask[i, : int(torch.randint(1, t + 1, (1,), generator=g))] = 1
        elif kind == "holes":
            mask[i] = (torch.rand(t, generator=g) < 0.6).float()
        elif kind == "full":
            mask[i] = 1
    if need_token and not mask.any():
        mask[int(torch.randint(b, (1,), generator=g)), int(torch.randint(t, (1,), generator=g))] = 1
    return mask, g


def with_junk(values: torch.Tensor, mask: torch.Tensor, junk, g: torch.Generator) -> torch.Tensor:
    """``values`` with every position outside ``mask`` replaced by junk (one value, or a random mixture)."""
    out = values.clone()
    outside = ~mask.bool()
    if junk == "mixed":
        pick = torch.randint(4, values.shape, generator=g)
        pool = torch.tensor([0.0, float("nan"), float("inf"), float("-inf")], dtype=values.dtype)
        out[outside] = pool[pick][outside]
    else:
        out[outside] = junk
    return out


@st.composite
def logprob_cases(draw, need_token: bool = True):
    """Rollout/old/new log-probs with a drawn gap, advantages, and junk outside the mask."""
    mask, g = draw(masks(need_token=need_token))
    b, t = mask.shape
    old = -torch.rand(b, t, generator=g) * 5
    gap = draw(st.sampled_from(GAPS))
    other = old + gap * torch.randn(b, t, generator=g)
    if draw(st.booleans()) and mask.any():  # one extreme token
        where = mask.nonzero()[int(torch.randint(int(mask.sum()), (1,), generator=g))]
        other[where[0], where[1]] = old[where[0], where[1]] + draw(st.sampled_from([-1e4, 1e4, -50.0, 50.0]))
    adv = torch.randn(b, t, generator=g) * draw(st.sampled_from([1e-3, 1.0, 100.0]))
    return dict(mask=mask, old=old, other=other, adv=adv, junk=draw(st.sampled_from(JUNK)), g=g)


@st.composite
def group_cases(draw, dtype=torch.float32):
    """Outcome rewards for groups of mixed kinds; every score sits on one token, so row sums are exact."""
    mask, g = draw(masks())
    b, t = mask.shape
    sizes, left = [], b
    while left:
        sizes.append(draw(st.integers(1, left)))
        left -= sizes[-1]
    scale = draw(st.sampled_from([1e-6, 1e-3, 1.0, 1e3, 1e6]))
    scores = torch.zeros(b, dtype=torch.float64)
    gid = torch.zeros(b, dtype=torch.long)
    order = torch.randperm(b, generator=g)  # interleave the groups' rows
    start = 0
    for k, size in enumerate(sizes):
        rows = order[start : start + size]
        start += size
        gid[rows] = k
        kind = draw(st.sampled_from(["random", "constant", "near", "binary"]))
        base = float(torch.randn(1, generator=g, dtype=torch.float64)) * scale
        if kind == "random":
            scores[rows] = torch.randn(size, generator=g, dtype=torch.float64) * scale
        elif kind == "constant":
            scores[rows] = base
        elif kind == "near":  # a few ulps apart: the worst case for a plain mean
            ulp = abs(base) * (EPS32 if dtype == torch.float32 else EPS64) + 1e-30
            scores[rows] = base + ulp * torch.randint(-2, 3, (size,), generator=g).to(torch.float64)
        else:
            scores[rows] = (torch.rand(size, generator=g, dtype=torch.float64) < 0.5).to(torch.float64)
    scores = scores.to(dtype)
    rewards = torch.zeros(b, t, dtype=dtype)
    col = torch.randint(t, (b,), generator=g)
    rewards[torch.arange(b), col] = scores
    if draw(st.booleans()):
        index = np.array([f"p{int(i)}" for i in gid], dtype=object)
    else:
        index = gid.numpy()
    return dict(mask=mask.to(dtype), rewards=rewards, scores=scores, gid=gid, index=index, g=g)


def _verl_config(**kw) -> ActorConfig:
    return ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1, **kw)


# ---------------------------------------------------------------------------- advantages
def _group_stats64(scores: torch.Tensor, gid: torch.Tensor):
    """Per row (group size, score range, max |score|, unbiased std), computed in fp64."""
    s = scores.double()
    n = torch.zeros_like(s)
    rng = torch.zeros_like(s)
    big = torch.zeros_like(s)
    std = torch.ones_like(s)
    for k in gid.unique():
        rows = gid == k
        n[rows] = rows.sum()
        rng[rows] = s[rows].max() - s[rows].min()
        big[rows] = s[rows].abs().max()
        std[rows] = s[rows].std() if rows.sum() > 1 else 1.0
    return n, rng, big, std


def _group_means64(scores: torch.Tensor, gid: torch.Tensor) -> torch.Tensor:
    """Per row the fp64 mean of its group (0 for a singleton, verl's convention)."""
    s = scores.double()
    out = torch.zeros_like(s)
    for k in gid.unique():
        rows = gid == k
        out[rows] = s[rows].mean() if rows.sum() > 1 else 0.0
    return out


def _verl_adv(name: str, rewards, mask, index, **kw):
    fn = {
        "grpo": core_algos.compute_grpo_outcome_advantage,
        "rloo": core_algos.compute_rloo_outcome_advantage,
        "opo": core_algos.compute_opo_outcome_advantage,
        "reinforce_plus_plus_baseline": core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage,
    }[name]
    if name == "grpo":
        return fn(rewards.clone(), mask, index, **kw)[0]
    return fn(token_level_rewards=rewards.clone(), response_mask=mask, index=index)[0]


def _fp64_reference(name, case, **kw):
    """verl in fp64 on exactly our fp32 scores (the row sums are exact, so this is the true value)."""
    rewards = torch.zeros_like(case["rewards"], dtype=torch.float64)
    rewards[:, 0] = case["scores"].double()
    return _verl_adv(name, rewards, case["mask"].double(), case["index"], **kw)


def _check_group_estimator(name: str, case: dict, norm: bool, epsilon: float = 1e-6) -> None:
    kw = {"norm_adv_by_std_in_grpo": norm, "epsilon": epsilon} if name == "grpo" else {}
    mask, index, gid = case["mask"], case["index"], case["gid"]
    ours, ret = A.compute_advantages(name, token_level_rewards=case["rewards"], response_mask=mask, index=index, **kw)
    assert torch.equal(ours, ret) and torch.isfinite(ours).all()
    n, rng, big, std = (x.unsqueeze(-1) for x in _group_stats64(case["scores"], gid))
    constant = (rng == 0) & (n > 1)
    assert (ours[constant.expand_as(ours)] == 0).all(), "a constant group must get advantage exactly 0"
    assert (ours[mask == 0] == 0).all()
    whitened = name == "reinforce_plus_plus_baseline"
    if whitened and mask.sum() < 2:
        with pytest.raises(ValueError):  # verl cannot whiten fewer than 2 tokens; we give no signal
            _verl_adv(name, case["rewards"], mask, index)
        assert (ours == 0).all()
        return
    ref = _fp64_reference(name, case, **kw)
    theirs = _verl_adv(name, case["rewards"], mask, index, **kw)
    if name == "grpo":
        denom = std + epsilon if norm else torch.ones_like(std)
        tight, loose = rng / denom, big / denom
    elif name == "rloo":
        tight, loose = 2 * rng, 2 * big
    elif name == "opo":
        tight, loose = rng, big
    else:  # whitened by the batch std of the centred scores (>= 1e-4 through the 1e-8 under the root)
        centred = case["scores"].double() - _group_means64(case["scores"], gid)
        per_token = centred.unsqueeze(-1).expand_as(mask)[mask.bool()]
        sigma = max(float(per_token.std()), 1e-4)
        # every row's error spreads through the batch mean and std: bound by the batch's largest values
        spread = float(per_token.abs().max())
        tokens = mask.sum() + n.max()
        tight = tokens * (rng.max() + spread) / sigma * torch.ones_like(rng)
        loose = tokens * (big.max() + spread) / sigma * torch.ones_like(rng)
    # verl divides a constant group's rounding residue by its std (+ epsilon): with epsilon 0 that is 0 / 0
    exact_zero_only = whitened or (name == "grpo" and norm and epsilon == 0)
    keep = mask.bool() & ~constant if exact_zero_only else torch.ones_like(mask, dtype=torch.bool)
    if name == "opo":  # verl divides 0 by 0 for a group whose rows have no tokens: NaN; ours are 0
        verl_nan = torch.isnan(ref)
        assert (ours[verl_nan] == 0).all()
        ref, theirs = torch.where(verl_nan, 0.0, ref), torch.where(verl_nan, 0.0, theirs)
    eps = EPS32 if ours.dtype == torch.float32 else EPS64
    # relative part at fp32 rounding in both dtypes: verl's singleton std is an fp32 constant (1 + 1e-6)
    tight_bound = 8 * (n + 2) * eps * tight + 8 * EPS32 * ref.abs() + 1e-300
    loose_bound = 8 * (n + 2) * eps * (loose + tight) + 8 * EPS32 * ref.abs() + 1e-300
    # against verl in our dtype: verl's own rounding (a mean of the raw scores)
    err_verl = (ours.double() - theirs.double()).abs()
    assert (err_verl <= loose_bound)[keep].all(), (err_verl - loose_bound)[keep].max()
    if ours.dtype == torch.float32:
        # against the exact value (verl in fp64 on our fp32 scores): the rounding of a mean of differences,
        # which stays small on near-constant groups where verl's fp32 result does not
        err_ours = (ours.double() - ref).abs()
        assert (err_ours <= tight_bound)[keep].all(), (err_ours - tight_bound)[keep].max()


GROUP_ESTIMATORS = ["grpo", "rloo", "opo", "reinforce_plus_plus_baseline"]


ANY_GROUP_CASE = st.sampled_from([torch.float32, torch.float64]).flatmap(lambda d: group_cases(dtype=d))


@given(case=ANY_GROUP_CASE, name=st.sampled_from(GROUP_ESTIMATORS), norm=st.booleans())
def test_group_estimators_match_verl(case, name, norm):
    _check_group_estimator(name, case, norm)



def _check_constant_groups(size, value, dtype, norm, name, others):
    """A batch holding a constant group next to other groups: the constant group's rows are exactly 0."""
    g = torch.Generator().manual_seed(size)
    b = size + others
    scores = torch.cat([torch.full((size,), value, dtype=torch.float64),
                        torch.randn(others, generator=g, dtype=torch.float64)]).to(dtype)
    rewards = torch.zeros(b, 3, dtype=dtype)
    rewards[:, -1] = scores
    mask = torch.ones(b, 3, dtype=dtype)
    index = np.array([0] * size + list(range(1, others + 1)))
    kw = {"norm_adv_by_std_in_grpo": norm}
    adv, _ = A.compute_advantages(name, token_level_rewards=rewards, response_mask=mask, index=index, **kw)
    assert (adv[:size] == 0).all(), adv[:size]
    assert torch.isfinite(adv).all()


@given(
    size=st.integers(2, 64),
    value=st.floats(allow_nan=False, allow_infinity=False, width=32),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    norm=st.booleans(),
    name=st.sampled_from(GROUP_ESTIMATORS),
    others=st.integers(0, 4),
)
@example(size=7, value=0.1, dtype=torch.float32, norm=True, name="grpo", others=0)  # verl: 0.0074
@example(size=64, value=7.7, dtype=torch.float32, norm=True, name="grpo", others=0)  # verl: 0.32
@example(size=7, value=100000.1, dtype=torch.float32, norm=True, name="grpo", others=2)  # verl: 0.93
@example(size=64, value=1 / 3, dtype=torch.float64, norm=False, name="rloo", others=1)
def test_constant_group_advantage_is_exactly_zero(size, value, dtype, norm, name, others):
    if name == "reinforce_plus_plus_baseline" and abs(value) > 1e18:
        others = 0  # other groups' huge random scores would overflow the whitening, not the point here
    _check_constant_groups(size, value, dtype, norm, name, others)


def test_verl_leaves_a_residue_on_constant_groups():
    """The artefact we fix: verl's fp32 GRPO gives a constant group of 0.1 (size 7) about 0.0074."""
    rewards = torch.zeros(7, 2)
    rewards[:, 1] = 0.1
    theirs, _ = core_algos.compute_grpo_outcome_advantage(rewards, torch.ones(7, 2), np.zeros(7, dtype=int))
    assert theirs.abs().max() > 1e-3
    ours, _ = A.compute_advantages("grpo", token_level_rewards=rewards, response_mask=torch.ones(7, 2),
                                   index=np.zeros(7, dtype=int))
    assert (ours == 0).all()


def test_singleton_groups_keep_verls_convention():
    rewards = torch.tensor([[0.0, 3.0], [0.0, -2.0]])
    mask = torch.ones(2, 2)
    index = np.array([0, 1])
    for name in GROUP_ESTIMATORS[:3]:
        ours, _ = A.compute_advantages(name, token_level_rewards=rewards, response_mask=mask, index=index)
        torch.testing.assert_close(ours, _verl_adv(name, rewards, mask, index), rtol=0, atol=0)


@st.composite
def token_reward_cases(draw):
    mask, g = draw(masks())
    b, t = mask.shape
    rewards = torch.randn(b, t, generator=g) * (torch.rand(b, t, generator=g) < 0.4)
    values = torch.randn(b, t, generator=g)
    junk = draw(st.sampled_from(JUNK))
    return dict(mask=mask, rewards=rewards, values=values, junk=junk, g=g,
                gamma=draw(st.sampled_from([1.0, 0.99, 0.5])), lam=draw(st.sampled_from([1.0, 0.95, 0.0])))


def _check_token_estimators(case):
    mask, g = case["mask"], case["g"]
    values_junk = with_junk(case["values"], mask, case["junk"], g)
    rewards_junk = with_junk(case["rewards"], mask, case["junk"], g)
    n_tokens = int(mask.sum())
    # gae: verl on clean inputs is the reference; ours on junk must match it
    ours_adv, ours_ret = A.compute_advantages("gae", token_level_rewards=rewards_junk, response_mask=mask,
                                              values=values_junk, gamma=case["gamma"], lam=case["lam"])
    assert torch.isfinite(ours_adv).all()
    if n_tokens < 2:
        with pytest.raises(ValueError):
            core_algos.compute_gae_advantage_return(case["rewards"], case["values"], mask, case["gamma"], case["lam"])
        assert (ours_adv == 0).all()
    else:
        ref_adv, ref_ret = core_algos.compute_gae_advantage_return(case["rewards"], case["values"], mask,
                                                                   case["gamma"], case["lam"])
        on = mask.bool()
        torch.testing.assert_close(ours_adv[on], ref_adv[on], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours_ret[on], ref_ret[on], rtol=1e-5, atol=1e-5)
    # reinforce_plus_plus ignores rewards at env tokens: junk there must not matter
    cfg = OmegaConf.create({"gamma": case["gamma"]})
    ours_adv, ours_ret = A.compute_advantages("reinforce_plus_plus", token_level_rewards=rewards_junk,
                                              response_mask=mask, gamma=case["gamma"])
    assert torch.isfinite(ours_adv).all() and torch.isfinite(ours_ret).all()
    if n_tokens < 2:
        assert (ours_adv == 0).all()
    else:
        ref_adv, ref_ret = core_algos.compute_reinforce_plus_plus_outcome_advantage(case["rewards"], mask, config=cfg)
        torch.testing.assert_close(ours_adv, ref_adv, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours_ret, ref_ret, rtol=1e-5, atol=1e-5)


@given(case=token_reward_cases())
def test_gae_and_reinforce_pp_match_verl(case):
    _check_token_estimators(case)



# ---------------------------------------------------------------------------- aggregation and KL
@st.composite
def batch_info(draw, mask: torch.Tensor):
    """verl's global_batch_info for a micro-batch that is one of ``dp_size`` equal shares (or none)."""
    if not draw(st.booleans()):
        return {}
    dp = draw(st.sampled_from([1, 2, 4]))
    tokens = float(mask.sum()) * dp + draw(st.integers(0, 5))
    rows = float((mask.sum(-1) > 0).sum()) * dp + draw(st.integers(0, 3))
    info = {"dp_size": dp, "batch_num_tokens": max(tokens, 1.0), "global_batch_size": max(rows, 1.0)}
    info["loss_scale_factor"] = draw(st.sampled_from([None, 1, 7, 4096]))
    return info


def _check_agg(case, mode, info):
    mask, g = case["mask"], case["g"]
    loss_mat = case["adv"] * torch.exp(case["other"].clamp(-20, 20) - case["old"])
    ours = A.agg_loss(with_junk(loss_mat, mask, case["junk"], g), mask, mode, **info)
    theirs = core_algos.agg_loss(loss_mat, mask, mode, **info)
    assert torch.isfinite(ours)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    bool_mask = A.agg_loss(loss_mat, mask.bool(), mode, **info)  # verl's actor passes a bool mask
    torch.testing.assert_close(bool_mask, theirs, rtol=1e-5, atol=1e-6)


@given(data=st.data(), mode=st.sampled_from(A.LOSS_AGG_MODES))
def test_agg_loss_matches_verl(data, mode):
    case = data.draw(logprob_cases())
    _check_agg(case, mode, data.draw(batch_info(case["mask"])))



KL_KINDS = [*A.KL_KINDS, *(f"{k}+" for k in A.KL_KINDS)]


def _check_kl(case, kind):
    a = case["other"].clone().requires_grad_(True)
    b = case["other"].clone().requires_grad_(True)
    ours = A.kl_penalty(a, case["old"], kind)
    theirs = core_algos.kl_penalty(b, case["old"], kind)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, equal_nan=True)
    mask = case["mask"]
    (ours * mask).sum().backward()
    (theirs * mask).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, equal_nan=True)


@given(case=logprob_cases(need_token=False), kind=st.sampled_from(KL_KINDS))
def test_kl_penalty_matches_verl(case, kind):
    _check_kl(case, kind)



# ---------------------------------------------------------------------------- policy losses
CLIPS = [(0.2, None, None, 3.0), (0.2, 0.1, 0.28, 3.0), (0.28, 0.2, 0.28, 1.5), (0.05, None, None, 10.0)]


def _check_policy_loss(case, name, mode, clip, with_is, info):
    mask, g, junk = case["mask"], case["g"], case["junk"]
    ratio, low, high, c = clip
    weights = torch.rand(mask.shape, generator=g) * 2 if with_is else None
    cfg = _verl_config(clip_ratio=ratio, clip_ratio_low=ratio if low is None else low,
                       clip_ratio_high=ratio if high is None else high, clip_ratio_c=c, global_batch_info=dict(info))
    a = with_junk(case["other"], mask, junk, g).requires_grad_(True)
    ours, om = A.policy_loss(
        name, old_log_prob=with_junk(case["old"], mask, junk, g), log_prob=a,
        advantages=with_junk(case["adv"], mask, junk, g), response_mask=mask, loss_agg_mode=mode,
        clip_ratio=ratio, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c,
        rollout_is_weights=None if weights is None else with_junk(weights, mask, junk, g), **info,
    )
    b = case["other"].clone().requires_grad_(True)
    theirs, tm = core_algos.get_policy_loss_fn(name)(case["old"], b, case["adv"], mask, mode, cfg, weights)
    assert torch.isfinite(ours)
    scale = max(1.0, float(theirs.detach().abs()))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6 * scale)
    ours.backward()
    theirs.backward()
    assert torch.isfinite(a.grad).all() and (a.grad[mask == 0] == 0).all()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6 * max(1.0, float(b.grad.abs().max())))
    for k, v in tm.items():
        assert om[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


POLICY_LOSS_INPUTS = given(
    data=st.data(),
    name=st.sampled_from(sorted(A.POLICY_LOSSES)),
    mode=st.sampled_from(A.LOSS_AGG_MODES),
    clip=st.sampled_from(CLIPS),
    with_is=st.booleans(),
)


@POLICY_LOSS_INPUTS
def test_policy_losses_match_verl(data, name, mode, clip, with_is):
    case = data.draw(logprob_cases(need_token=True))
    _check_policy_loss(case, name, mode, clip, with_is, data.draw(batch_info(case["mask"])))



# ---------------------------------------------------------------------------- rollout correction
IS_MODES = [
    dict(rollout_is=level, rollout_is_threshold=thr, rollout_is_batch_normalize=norm)
    for level in ("token", "sequence")
    for thr in (2.0, 1.001, 5.0, "0.8_1.25", "0.5_2.0", "1e-3_1e3")
    for norm in (False, True)
]
RS_SPECS = [
    ("token_k1", "0.8_1.25"), ("token_k1", 2.0), ("token_k2", 0.02), ("token_k3", 0.01),
    ("seq_sum_k1", "0.5_2.0"), ("seq_sum_k2", 0.5), ("seq_sum_k3", 0.1),
    ("seq_mean_k1", 1.5), ("seq_mean_k2", 0.05), ("seq_mean_k3", 0.02),
    ("seq_max_k2", 0.5), ("seq_max_k3", 0.2),
]


@st.composite
def correction_modes(draw):
    kw = dict(draw(st.sampled_from([{}, *IS_MODES])))
    specs = draw(st.lists(st.sampled_from(RS_SPECS), max_size=3, unique_by=lambda s: s[0]))
    if specs:
        kw["rollout_rs"] = ",".join(o for o, _ in specs)
        kw["rollout_rs_threshold"] = ",".join(str(t) for _, t in specs)
    return kw


def _same_metric(ours: float, theirs: float, key: str) -> None:
    if math.isinf(theirs) or math.isnan(theirs):
        assert ours == theirs or (math.isnan(ours) and math.isnan(theirs)), (key, ours, theirs)
    else:
        assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6), key


def _check_correction(case, kw):
    mask, g, junk = case["mask"], case["g"], case["junk"]
    old, roll = case["old"], case["other"]
    w, m, met = A.rollout_correction(old_log_prob=with_junk(old, mask, junk, g),
                                     rollout_log_prob=with_junk(roll, mask, junk, g), response_mask=mask, **kw)
    try:
        proto, tmask, tmet = rch.compute_rollout_correction_and_rejection_mask(old, roll, mask, **kw)
    except ZeroDivisionError:  # verl's ESS is 1.0 / <python float 0>: every IS weight is 0 (IcePop)
        assert w is not None and (w == 0).all() and met["rollout_corr/rollout_is_eff_sample_size"] == 0.0
        return
    tw = None if proto is None else proto.batch["rollout_is_weights"]
    assert (w is None) == (tw is None)
    if w is not None:
        assert torch.isfinite(w).all() and (w[mask == 0] == 0).all() and (w >= 0).all()
        torch.testing.assert_close(w, tw, rtol=1e-5, atol=1e-6)
    assert torch.equal(m, tmask) and m.dtype == mask.dtype
    assert set(m.unique().tolist()) <= {0.0, 1.0}
    assert set(met) - set(tmet) == {"rollout_corr/logprob_abs_diff_mean", "rollout_corr/logprob_abs_diff_max"}
    for k, v in tmet.items():
        _same_metric(met[k], v, k)
    w2, m2, met2 = A.rollout_correction(old_log_prob=with_junk(old, mask, junk, g),
                                        rollout_log_prob=with_junk(roll, mask, junk, g), response_mask=mask,
                                        with_metrics=False, **kw)
    assert met2 == {} and torch.equal(m2, m) and (w is None or torch.equal(w2, w))


@given(case=logprob_cases(need_token=True), kw=correction_modes())
def test_rollout_correction_matches_verl(case, kw):
    _check_correction(case, kw)



@pytest.mark.parametrize("kw", [*IS_MODES[:12], *({"rollout_rs": o, "rollout_rs_threshold": t} for o, t in RS_SPECS)])
def test_extreme_gap_saturates_like_verl(kw):
    """Every row 1e4 nats apart, one single-token row, one empty row, NaN outside: verl reports inf for
    rollout_is_min (sequence IS), k3_kl and the PPLs; so do we, without a Python overflow."""
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    old = torch.full((3, 3), -1.0)
    roll = old - 1e4
    w, m, met = A.rollout_correction(old_log_prob=torch.where(mask.bool(), old, float("nan")),
                                     rollout_log_prob=torch.where(mask.bool(), roll, float("-inf")),
                                     response_mask=mask, **kw)
    assert math.isinf(met["rollout_corr/k3_kl"])
    if w is not None:
        assert torch.isfinite(w).all() and (w[mask == 0] == 0).all()
    try:
        proto, tmask, tmet = rch.compute_rollout_correction_and_rejection_mask(old, roll, mask, **kw)
    except ZeroDivisionError:  # verl's IcePop ESS on all-zero weights; ours reports 0
        assert (w == 0).all() and met["rollout_corr/rollout_is_eff_sample_size"] == 0.0
        return
    assert math.isinf(tmet["rollout_corr/k3_kl"])
    for k, v in tmet.items():
        _same_metric(met[k], v, k)
    if w is not None:
        torch.testing.assert_close(w, proto.batch["rollout_is_weights"])
    assert torch.equal(m, tmask)


def test_sequence_is_min_overflows_to_inf_not_an_exception():
    mask = torch.ones(2, 4)
    old = torch.zeros(2, 4)
    roll = old - 1e4  # every row's log-ratio sum is 4e4: exp overflows
    _, _, met = A.rollout_correction(old_log_prob=old, rollout_log_prob=roll, response_mask=mask,
                                     rollout_is="sequence", rollout_is_threshold=2.0)
    _, _, tmet = rch.compute_rollout_correction_and_rejection_mask(old, roll, mask, rollout_is="sequence",
                                                                   rollout_is_threshold=2.0)
    assert met["rollout_corr/rollout_is_min"] == tmet["rollout_corr/rollout_is_min"] == float("inf")
