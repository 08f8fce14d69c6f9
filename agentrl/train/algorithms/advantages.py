"""Advantage estimators: pure tensor functions selected by name.

Our own implementations of the estimators verl 0.9.1 ships in ``verl/trainer/ppo/core_algos.py`` (same
maths and edge cases, checked against verl in ``tests/test_algos_parity.py``), so the trainer runs without
verl installed.

Every estimator takes keyword arguments and returns ``(advantages, returns)``, both ``[B, T]`` float tensors
zeroed outside ``response_mask`` (except GAE returns, which are ``advantages + values`` as in verl).

Inputs common to all estimators:
  token_level_rewards: ``[B, T]`` float; outcome estimators use the row sum as the sequence score.
  response_mask: ``[B, T]``, 1 = model token, 0 = env/pad token.
  index: length-B group ids (numpy array, list or 1-D tensor of any hashable values): rows sharing an id
    are samples of the same prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from agentrl.train.algorithms._masked import masked_whiten

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator adding an estimator to :data:`ADVANTAGE_ESTIMATORS` under ``name``."""

    def deco(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

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


def _group_stats(scores: torch.Tensor, gid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row group ``(count, mean, unbiased std)``; singleton groups get mean 0 and std 1."""
    n_groups = int(gid.max()) + 1
    count = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, gid, torch.ones_like(scores)
    )
    total = torch.zeros_like(count).index_add_(0, gid, scores)
    mean = total / count
    sq = torch.zeros_like(count).index_add_(0, gid, (scores - mean[gid]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return count[gid], mean[gid], std[gid]


@register_advantage("grpo")
def grpo(*, token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True, **_):
    """GRPO outcome advantage: ``(score - group mean) / (group std + epsilon)``, broadcast over tokens.

    With ``norm_adv_by_std_in_grpo=False`` the std division is skipped (Dr.GRPO).
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        _, mean, std = _group_stats(scores, _group_ids(index, scores.shape[0], scores.device))
        adv = (scores - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else scores - mean
        adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_advantage("rloo")
def rloo(*, token_level_rewards, response_mask, index, **_):
    """RLOO: ``score - mean(other samples of the group)``; singleton groups keep the raw score."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        count, mean, _ = _group_stats(scores, _group_ids(index, scores.shape[0], scores.device))
        scale = count / (count - 1).clamp(min=1)
        adv = torch.where(count > 1, (scores - mean) * scale, scores)
        adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_advantage("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(*, token_level_rewards, response_mask, index, **_):
    """REINFORCE++ with a group-mean baseline, then whitened over all unmasked tokens of the batch."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        _, mean, _ = _group_stats(scores, _group_ids(index, scores.shape[0], scores.device))
        adv = (scores - mean).unsqueeze(-1).expand_as(response_mask) * response_mask
        adv = masked_whiten(adv, response_mask) * response_mask
    return adv, adv


@register_advantage("opo")
def opo(*, token_level_rewards, response_mask, index, **_):
    """OPO: score minus the length-weighted group mean score (singleton groups: baseline 0)."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        lengths = response_mask.sum(dim=-1).to(scores.dtype)
        gid = _group_ids(index, scores.shape[0], scores.device)
        n_groups = int(gid.max()) + 1
        zeros = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
        count = zeros.clone().index_add_(0, gid, torch.ones_like(scores))
        weighted = zeros.clone().index_add_(0, gid, lengths * scores)
        total_len = zeros.clone().index_add_(0, gid, lengths)
        baseline = torch.where(count > 1, weighted / total_len, zeros)
        adv = (scores - baseline[gid]).unsqueeze(-1) * response_mask
    return adv, adv


def _discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go over model tokens; env tokens pass the running return through unchanged."""
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t].to(rewards.dtype)
        new = rewards[:, t] + gamma * running
        returns[:, t] = new * m
        running = new * m + running * (1 - m)
    return returns


@register_advantage("reinforce_plus_plus")
def reinforce_plus_plus(*, token_level_rewards, response_mask, gamma=1.0, **_):
    """REINFORCE++: discounted reward-to-go, whitened over all unmasked tokens of the batch."""
    with torch.no_grad():
        returns = _discounted_returns(token_level_rewards, response_mask, gamma)
        adv = masked_whiten(returns, response_mask) * response_mask
    return adv, returns


@register_advantage("gae")
def gae(*, token_level_rewards, response_mask, values=None, gamma=1.0, lam=1.0, **_):
    """Generalised Advantage Estimation with a critic's ``values`` ``[B, T]``.

    Env tokens (mask 0) are skipped: they neither bootstrap a value nor reset the running GAE. Returns are
    ``advantages + values`` before whitening; advantages are then whitened over unmasked tokens.
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
            m = response_mask[:, t].to(values.dtype)
            delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
            candidate = delta + gamma * lam * running
            next_value = values[:, t] * m + (1 - m) * next_value
            running = candidate * m + (1 - m) * running
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
    """Run the estimator registered as ``name``; returns ``(advantages, returns)``, each ``[B, T]``.

    Names: see :data:`ADVANTAGE_ESTIMATORS` (``grpo``, ``rloo``, ``gae``, ``reinforce_plus_plus``,
    ``reinforce_plus_plus_baseline``, ``opo``). Group estimators need ``index``; ``gae`` needs ``values``.
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
