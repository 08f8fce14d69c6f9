"""Advantage estimators: pure tensor functions selected by name.

Our own implementations of the estimators verl 0.9.1 ships in ``verl/trainer/ppo/core_algos.py`` (same
maths and edge cases, checked against verl in ``tests/test_algos_parity.py``), so the trainer runs without
verl installed.

Every estimator takes keyword arguments and returns ``(advantages, returns)``, both ``[B, T]`` float tensors
zeroed outside ``response_mask`` (except GAE, as in verl: its whitened advantages are defined on every
position, and its returns are ``advantages + values``). Where verl's results are exact, ours agree to rounding;
where verl's are rounding artefacts we are exact: a group whose scores are all equal gets advantage exactly
0 (grpo, rloo, opo, reinforce_plus_plus_baseline); junk (NaN, inf) at env tokens in ``values`` (gae) or in
the rewards of the reward-to-go estimators (gae, reinforce_plus_plus), which verl multiplies by a zero mask
into NaN, never reaches the result. (The outcome estimators score a row by the sum of all its token rewards,
env tokens included, as verl does.) fp16 and bf16 inputs are computed, and returned, in fp32 (see
:func:`register_advantage`); in fp16 a group's sum of squares overflows and a whitening's ``1e-8`` vanishes.

The whitened estimators (``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``, ``gae``) normalise over
the whole batch they are given: under data parallelism pass them every rank's rows, as verl does on its
driver (:func:`agentrl.train.update.batch_advantages` gathers them).

Inputs common to all estimators:
  token_level_rewards: ``[B, T]`` float; outcome estimators use the row sum as the sequence score.
  response_mask: ``[B, T]``, 1 = model token, 0 = env/pad token.
  index: length-B group ids (numpy array, list or 1-D tensor of any hashable values): rows sharing an id
    are samples of the same prompt.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from agentrl.train.algorithms._masked import masked_whiten, promote

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {}


_TENSOR_ARGS = ("token_level_rewards", "response_mask", "values")


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator adding an estimator to :data:`ADVANTAGE_ESTIMATORS` under ``name``.

    The estimator is registered (and returned) wrapped so that its tensor arguments (``token_level_rewards``,
    ``response_mask``, ``values``) arrive promoted to the compute dtype (fp32, or fp64 if one is fp64; see
    :func:`~agentrl.train.algorithms._masked.promote`): fp16/bf16 rewards are summed, centred and whitened in
    fp32, and the advantages come back in fp32.
    """

    def deco(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")

        @functools.wraps(fn)
        def promoted(**kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            keys = [k for k in _TENSOR_ARGS if isinstance(kwargs.get(k), torch.Tensor)]
            kwargs.update(zip(keys, promote(*(kwargs[k] for k in keys)), strict=True))
            return fn(**kwargs)

        ADVANTAGE_ESTIMATORS[name] = promoted
        return promoted

    return deco


def _group_ids(
    index: Sequence[Any] | np.ndarray | torch.Tensor, batch: int, device: torch.device
) -> torch.Tensor:
    """Map arbitrary group ids to dense int64 ids ``[B]`` (first-seen order)."""
    if isinstance(index, torch.Tensor):
        index = index.tolist()
    keys = list(index.tolist() if isinstance(index, np.ndarray) else index)
    if len(keys) != batch:
        raise ValueError(
            f"index has {len(keys)} entries but the batch has {batch} rows; give one group id per row"
        )
    dense: dict[Any, int] = {}
    ids = [dense.setdefault(k, len(dense)) for k in keys]
    return torch.tensor(ids, dtype=torch.long, device=device)


def _group_sum(values: torch.Tensor, gid: torch.Tensor, n_groups: int) -> torch.Tensor:
    return torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(0, gid, values)


def _group_centered(scores: torch.Tensor, gid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row ``(group size, score - group mean, unbiased group std)``, each ``[B]``.

    The mean is taken of the differences to the group's first score (a shifted mean), so a group of equal
    scores gives differences of exactly 0, a centred score of exactly 0 and a std of exactly 0 in any
    dtype, for any size and value; verl's plain mean leaves a rounding residue there that the std division
    blows up (~0.1 in fp32). Elsewhere the two agree to rounding. The std is summed over centred scores
    scaled by the group's largest one (as BLAS ``nrm2`` does), so it is 0 exactly when every centred score
    is 0: squares that underflow (differences near 1e-20 in fp32) or overflow cannot make it 0 or inf.
    Singleton groups follow verl: mean 0 and std 1, i.e. the centred score is the score itself.
    """
    n_groups = int(gid.max()) + 1
    count = _group_sum(torch.ones_like(scores), gid, n_groups)
    first = torch.full((n_groups,), len(scores), dtype=torch.long, device=scores.device)
    first = first.scatter_reduce(0, gid, torch.arange(len(scores), device=scores.device), reduce="amin")
    diff = scores - scores[first][gid]
    centered = diff - (_group_sum(diff, gid, n_groups) / count)[gid]
    peak = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
    peak = peak.scatter_reduce(0, gid, centered.abs(), reduce="amax")
    unit = torch.where(peak > 0, peak, torch.ones_like(peak))
    var = _group_sum((centered / unit[gid]).square(), gid, n_groups) / (count - 1).clamp(min=1)
    single = count[gid] == 1
    centered = torch.where(single, scores, centered)
    std = torch.where(single, torch.ones_like(scores), (unit * var.sqrt())[gid])
    return count[gid], centered, std


def _constant_groups(scores: torch.Tensor, gid: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: the row's group has at least two members and all its scores are equal."""
    n_groups = int(gid.max()) + 1
    hi = torch.full((n_groups,), float("-inf"), dtype=scores.dtype, device=scores.device)
    lo = torch.full((n_groups,), float("inf"), dtype=scores.dtype, device=scores.device)
    hi = hi.scatter_reduce(0, gid, scores, reduce="amax")
    lo = lo.scatter_reduce(0, gid, scores, reduce="amin")
    count = _group_sum(torch.ones_like(scores), gid, n_groups)
    return ((hi == lo) & (count > 1))[gid]


@register_advantage("grpo")
def grpo(*, token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True, **_):
    """GRPO outcome advantage: ``(score - group mean) / (group std + epsilon)``, broadcast over tokens.

    Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
    https://arxiv.org/abs/2402.03300. With ``norm_adv_by_std_in_grpo=False`` the std division is skipped:
    Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective",
    https://arxiv.org/abs/2503.20783.

    Args:
        token_level_rewards: ``[B, T]`` float; the row sum is the sequence score.
        response_mask: ``[B, T]``, 1 = model token.
        index: ``B`` group ids (rows with one id are samples of one prompt).
        epsilon: ``>= 0``, added to the group std (unbiased; 1 for a singleton group).
        norm_adv_by_std_in_grpo: divide by the group std.

    Returns:
        ``(advantages, returns)``: both the same ``[B, T]`` float tensor, 0 outside ``response_mask``.
        A group of equal scores gets exactly 0 (see :func:`_group_centered`), with ``epsilon=0`` too (verl
        divides 0 by 0 there: NaN).

    Raises:
        ValueError: ``epsilon`` is negative or NaN.
    """
    if not epsilon >= 0:
        raise ValueError(f"epsilon must be >= 0 (it is added to the group std of GRPO), got {epsilon}")
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        _, centered, std = _group_centered(scores, _group_ids(index, scores.shape[0], scores.device))
        if norm_adv_by_std_in_grpo:  # std is 0 only for a constant group, whose centred scores are all 0
            adv = torch.where(std > 0, centered / (std + epsilon), centered)
        else:
            adv = centered
        adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_advantage("rloo")
def rloo(*, token_level_rewards, response_mask, index, **_):
    """RLOO: ``score - mean(other samples of the group)``, broadcast over tokens.

    Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
    Feedback in LLMs", https://arxiv.org/abs/2402.14740 (the leave-one-out baseline of Kool et al. 2019).

    Args:
        token_level_rewards: ``[B, T]`` float; the row sum is the sequence score.
        response_mask: ``[B, T]``, 1 = model token.
        index: ``B`` group ids.

    Returns:
        ``(advantages, returns)``: both the same ``[B, T]`` tensor, 0 outside ``response_mask``; a
        singleton group keeps its raw score, a group of equal scores gets exactly 0.
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        count, centered, _ = _group_centered(scores, _group_ids(index, scores.shape[0], scores.device))
        scale = count / (count - 1).clamp(min=1)
        adv = torch.where(count > 1, centered * scale, scores)
        adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_advantage("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(*, token_level_rewards, response_mask, index, **_):
    """REINFORCE++ with a group-mean baseline, then whitened over all unmasked tokens of the batch.

    Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models",
    https://arxiv.org/abs/2501.03262 (the "baseline" variant for outcome rewards).

    Args:
        token_level_rewards: ``[B, T]`` float; the row sum is the sequence score.
        response_mask: ``[B, T]``, 1 = model token.
        index: ``B`` group ids.

    Returns:
        ``(advantages, returns)``: both the same ``[B, T]`` tensor, 0 outside ``response_mask``.
        Rows of a group of equal scores get exactly 0 after the whitening too (verl gives them minus the
        batch mean over the batch std: a push from other prompts' statistics on samples without signal).
        The whitening statistics still include their tokens, as in verl, so every other row matches verl.
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        gid = _group_ids(index, scores.shape[0], scores.device)
        _, centered, _ = _group_centered(scores, gid)
        adv = centered.unsqueeze(-1).expand_as(response_mask) * response_mask
        adv = masked_whiten(adv, response_mask) * response_mask
        adv = torch.where(_constant_groups(scores, gid).unsqueeze(-1), torch.zeros_like(adv), adv)
    return adv, adv


@register_advantage("opo")
def opo(*, token_level_rewards, response_mask, index, **_):
    """OPO: score minus the length-weighted group mean score, broadcast over tokens.

    Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline", https://arxiv.org/abs/2505.23585 (the
    baseline ``sum_i |y_i| r_i / sum_i |y_i|`` over the group, ``|y_i|`` the model tokens of row ``i``).

    Args:
        token_level_rewards: ``[B, T]`` float; the row sum is the sequence score.
        response_mask: ``[B, T]``, 1 = model token (the row length is its sum).
        index: ``B`` group ids.

    Returns:
        ``(advantages, returns)``: both the same ``[B, T]`` tensor, 0 outside ``response_mask``; a
        singleton group has baseline 0. Computed on differences to the group's first score, so a group of
        equal scores gets exactly 0; a group whose rows have no model tokens at all gets 0 (verl divides 0
        by 0 there and returns NaN).
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        lengths = response_mask.sum(dim=-1).to(scores.dtype)
        gid = _group_ids(index, scores.shape[0], scores.device)
        n_groups = int(gid.max()) + 1
        count = _group_sum(torch.ones_like(scores), gid, n_groups)
        first = torch.full((n_groups,), len(scores), dtype=torch.long, device=scores.device)
        first = first.scatter_reduce(0, gid, torch.arange(len(scores), device=scores.device), reduce="amin")
        diff = scores - scores[first][gid]
        total_len = _group_sum(lengths, gid, n_groups)
        baseline = _group_sum(lengths * diff, gid, n_groups) / torch.where(total_len > 0, total_len, 1.0)
        adv = torch.where(count[gid] > 1, diff - baseline[gid], scores)
        adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


def _discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go over model tokens; env tokens pass the running return through unchanged."""
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t].bool()
        new = rewards[:, t] + gamma * running
        returns[:, t] = torch.where(m, new, torch.zeros_like(new))
        running = torch.where(m, new, running)
    return returns


@register_advantage("reinforce_plus_plus")
def reinforce_plus_plus(*, token_level_rewards, response_mask, gamma=1.0, **_):
    """REINFORCE++: discounted reward-to-go, whitened over all unmasked tokens of the batch.

    Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models",
    https://arxiv.org/abs/2501.03262.

    Args:
        token_level_rewards: ``[B, T]`` float per-token rewards.
        response_mask: ``[B, T]``, 1 = model token; env tokens pass the running return through unchanged.
        gamma: discount per model token.

    Returns:
        ``(advantages [B, T]`` whitened and 0 outside the mask, ``returns [B, T])`` the reward-to-go.
    """
    with torch.no_grad():
        returns = _discounted_returns(token_level_rewards, response_mask, gamma)
        adv = masked_whiten(returns, response_mask) * response_mask
    return adv, returns


@register_advantage("gae")
def gae(*, token_level_rewards, response_mask, values=None, gamma=1.0, lam=1.0, **_):
    """Generalised Advantage Estimation with a critic's values.

    Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation",
    https://arxiv.org/abs/1506.02438.

    Args:
        token_level_rewards: ``[B, T]`` float per-token rewards.
        response_mask: ``[B, T]``, 1 = model token. Env tokens are skipped: they neither bootstrap a value
            nor reset the running GAE, and junk in their values never reaches the result.
        values: ``[B, T]`` float critic values (required).
        gamma: discount; lam: the GAE lambda.

    Returns:
        ``(advantages, returns)``, both ``[B, T]``: returns are ``advantages + values`` before whitening;
        advantages are then whitened over unmasked tokens (defined on every position, as in verl).

    Raises:
        ValueError: ``values`` is missing.
    """
    if values is None:
        raise ValueError(
            "'gae' needs values=[B, T] from a critic; use 'grpo' or 'rloo' for critic-free training"
        )
    with torch.no_grad():
        next_value = torch.zeros_like(values[:, 0])
        running = torch.zeros_like(values[:, 0])
        adv = torch.zeros_like(values)
        for t in reversed(range(values.shape[1])):
            m = response_mask[:, t].bool()  # selected, not multiplied: junk in env-token values stays out
            delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
            candidate = delta + gamma * lam * running
            next_value = torch.where(m, values[:, t], next_value)
            running = torch.where(m, candidate, running)
            adv[:, t] = running
        returns = adv + values
        adv = masked_whiten(adv, response_mask)
    return adv, returns


def compute_advantages(
    name: str,
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any] | np.ndarray | torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator registered as ``name`` (verl's ``compute_advantage`` dispatch).

    Args:
        name: one of :data:`ADVANTAGE_ESTIMATORS` (``grpo``, ``rloo``, ``gae``, ``reinforce_plus_plus``,
            ``reinforce_plus_plus_baseline``, ``opo``); see each function for its paper.
        token_level_rewards: ``[B, T]`` float.
        response_mask: ``[B, T]``, 1 = model token.
        index: ``B`` group ids (group estimators).
        values: ``[B, T]`` critic values (``gae``).
        gamma, lam, norm_adv_by_std_in_grpo, epsilon: the estimators' parameters.

    Returns:
        ``(advantages, returns)``, each ``[B, T]`` float.

    Raises:
        ValueError: an unknown name (listing the valid ones), mismatched shapes, a group estimator without
            ``index``, ``gae`` without ``values``, a negative or NaN ``epsilon`` (``grpo``).
    """
    fn = ADVANTAGE_ESTIMATORS.get(name)
    if fn is None:
        raise ValueError(
            f"unknown advantage estimator {name!r}; choose one of {sorted(ADVANTAGE_ESTIMATORS)}"
        )
    if token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must have the same [B, T] shape"
        )
    if name in ("grpo", "rloo", "opo", "reinforce_plus_plus_baseline") and index is None:
        raise ValueError(f"{name!r} groups samples by prompt: pass index=<one group id per row>")
    return fn(
        token_level_rewards=token_level_rewards,
        response_mask=response_mask,
        index=index,
        values=values,
        gamma=gamma,
        lam=lam,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        epsilon=epsilon,
    )
