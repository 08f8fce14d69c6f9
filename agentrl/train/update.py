"""One policy update on a collated rollout batch: old/ref log-probs, advantages, PPO mini-batches.

The algorithms are the pure functions of :mod:`agentrl.train.algorithms`; this module only wires them
to the model:

- advantages from ``algorithm.adv_estimator`` over the task groups;
- the on-policy fix: with ``actor.ppo_epochs == actor.num_mini_batches == 1`` there is exactly one
  optimizer step, and ``old_log_prob = log_prob.detach()`` of that very forward (ratio exactly 1);
  otherwise a separate no-grad pass computes ``old_log_prob`` first (logged as ``actor/on_policy``);
- rollout correction (``algorithm.rollout_correction.*``) against the engine's log-probs, which also
  yields the rollout-vs-train gap metrics (``rollout_corr/logprob_abs_diff_mean|max``, ``rollout_corr/k3_kl``);
- optional KL loss to a frozen reference model, optional entropy bonus, gradient accumulation over
  micro-batches with totals passed to ``agg_loss`` so the accumulated loss equals the full-batch loss.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import torch

from agentrl.models.routing import align_to_mask, replay_routing
from agentrl.train import distributed
from agentrl.train.algorithms import (
    agg_loss,
    compute_advantages,
    is_on_policy,
    kl_penalty,
    policy_loss,
    rollout_correction,
)
from agentrl.train.batch import Batch
from agentrl.train.logprobs import model_token_logprobs
from agentrl.train.prefix_sharing import shared_prefix_logprobs


def _trimmed(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """Drop all-padding columns of a (micro-)batch: returns ``(input_ids, attention_mask, position_ids,
    response_start, response_width)`` where the response occupies columns ``response_start..``."""
    width_p = batch.prompt_width
    real = batch.attention_mask.bool()
    first = int(real.any(0).float().argmax())  # first column holding any real token
    resp_cols = batch.response_mask.bool().any(0) | real[:, width_p:].any(0)
    width_r = int(resp_cols.nonzero().max()) + 1 if resp_cols.any() else 1
    first = min(first, width_p - 1)
    end = width_p + width_r
    return (
        batch.input_ids[:, first:end],
        batch.attention_mask[:, first:end],
        batch.position_ids[:, first:end],
        width_p - first,
        width_r,
    )


def forward_logprobs(
    model: Any, batch: Batch, *, chunk_size: int, temperature: float, compute_entropy: bool,
    routing: list[torch.Tensor] | None = None, share_prefix: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of ``batch.responses`` under ``model``: ``[B, R]`` fp32, zero-padded
    to the batch's full response width. Differentiable unless called under ``torch.no_grad()``.
    ``routing``: per-row ``[L, n_i, k]`` recorded experts of the row's first ``n_i`` tokens, replayed
    in this forward (MoE routing replay); other tokens route normally. ``share_prefix``: compute the
    rows' common prompt prefix once (:mod:`agentrl.train.prefix_sharing`) when the model allows it."""
    if share_prefix and routing is None:
        shared = shared_prefix_logprobs(
            model, batch, chunk_size=chunk_size, temperature=temperature, compute_entropy=compute_entropy
        )
        if shared is not None:
            return shared
    ids, attn, pos, start, width_r = _trimmed(batch)
    replay = nullcontext()
    if routing is not None:
        replay = replay_routing(model, align_to_mask(routing, attn))
    with replay:
        lp, ent = model_token_logprobs(
            model,
            ids,
            attn,
            response_start=start,
            chunk_size=chunk_size,
            temperature=temperature,
            compute_entropy=compute_entropy,
            position_ids=pos,
        )
    full = batch.responses.shape[1]
    if width_r < full:
        lp = torch.nn.functional.pad(lp, (0, full - width_r))
        ent = None if ent is None else torch.nn.functional.pad(ent, (0, full - width_r))
    return lp, ent


def _rows(routing: list[torch.Tensor] | None, rows: torch.Tensor) -> list[torch.Tensor] | None:
    return None if routing is None else [routing[int(r)] for r in rows]


def _micro_batches(rows: torch.Tensor, size: int) -> Iterator[torch.Tensor]:
    for start in range(0, len(rows), size):
        yield rows[start : start + size]


@torch.no_grad()
def batched_logprobs(model: Any, batch: Batch, *, micro_batch_size: int, chunk_size: int, temperature: float,
                     routing: list[torch.Tensor] | None = None, share_prefix: bool = False) -> torch.Tensor:
    """No-grad ``[B, R]`` log-probs over micro-batches (old-policy or reference pass)."""
    out = torch.zeros_like(batch.rollout_log_probs)
    rows = torch.arange(len(batch))
    for mb in _micro_batches(rows, micro_batch_size):
        lp, _ = forward_logprobs(model, batch.select(mb), chunk_size=chunk_size, temperature=temperature,
                                 compute_entropy=False, routing=_rows(routing, mb), share_prefix=share_prefix)
        out[mb.to(out.device)] = lp
    return out


def _mean_metrics(collected: dict[str, list[float]]) -> dict[str, float]:
    return {k: sum(v) / len(v) for k, v in collected.items() if v}


def update_policy(
    *,
    model: Any,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    cfg: Any,
    temperature: float,
    ref_model: Any | None = None,
    generator: torch.Generator | None = None,
    routing: list[torch.Tensor] | None = None,
) -> dict[str, float]:
    """Run ``cfg.actor.ppo_epochs`` x ``cfg.actor.num_mini_batches`` optimizer steps on ``batch`` (already
    on the model's device). ``cfg`` is the full train config. ``routing``: per-row rollout MoE routing
    to replay in every policy forward (routing replay), or None. Returns step metrics (verl names)."""
    actor, algo = cfg.actor, cfg.algorithm
    rc = algo.rollout_correction
    metrics: dict[str, float] = {}
    timing: dict[str, float] = defaultdict(float)
    mask = batch.response_mask
    advantages, _ = compute_advantages(
        algo.adv_estimator,
        token_level_rewards=batch.token_level_rewards,
        response_mask=mask,
        index=batch.index,
        gamma=algo.gamma,
        lam=algo.lam,
        norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo,
        epsilon=algo.epsilon,
    )
    on_policy = is_on_policy(actor.ppo_epochs, actor.num_mini_batches)
    metrics["actor/on_policy"] = float(on_policy)
    chunk, micro = actor.logprob_chunk_size, actor.micro_batch_size
    share = actor.share_prompt_prefix

    old_log_prob = None
    is_weights = None
    train_mask = mask
    rc_options = dict(rollout_is=rc.rollout_is, rollout_is_threshold=rc.rollout_is_threshold,
                      rollout_rs=rc.rollout_rs, rollout_rs_threshold=rc.rollout_rs_threshold)
    if not on_policy:
        t0 = time.perf_counter()
        old_log_prob = batched_logprobs(model, batch, micro_batch_size=micro, chunk_size=chunk, temperature=temperature,
                                        routing=routing, share_prefix=share)
        timing["timing_s/old_log_prob"] = time.perf_counter() - t0
        is_weights, train_mask, rc_metrics = rollout_correction(
            old_log_prob=old_log_prob,
            rollout_log_prob=batch.rollout_log_probs,
            response_mask=mask,
            **rc_options,
        )
        metrics.update(rc_metrics)
    ref_log_prob = None
    if ref_model is not None:
        t0 = time.perf_counter()
        ref_log_prob = batched_logprobs(ref_model, batch, micro_batch_size=micro, chunk_size=chunk, temperature=temperature,
                                        share_prefix=share)
        timing["timing_s/ref"] = time.perf_counter() - t0

    params = [p for p in model.parameters() if p.requires_grad]
    collected: dict[str, list[float]] = defaultdict(list)
    t0 = time.perf_counter()
    trained_tokens = 0
    for _epoch in range(actor.ppo_epochs):
        order = torch.randperm(len(batch), generator=generator) if actor.num_mini_batches > 1 else torch.arange(len(batch))
        for mini in order.chunk(actor.num_mini_batches):
            optimizer.zero_grad(set_to_none=True)
            mini_mask = train_mask[mini.to(train_mask.device)]
            # global counts (this rank's share of them under torchrun), so the step is the full batch's
            num_tokens = distributed.global_share(mini_mask.sum()).clamp(min=1)
            num_rows = distributed.global_share((mini_mask.sum(-1) > 0).sum()).clamp(min=1)
            for mb in _micro_batches(mini, micro):
                rows = mb.to(mask.device)
                sub = batch.select(mb)
                sub_mask = train_mask[rows]
                if not sub_mask.any() and not distributed.is_distributed():  # ranks keep FSDP collectives in step
                    continue
                log_prob, entropy = forward_logprobs(model, sub, chunk_size=chunk, temperature=temperature,
                                                     compute_entropy=True, routing=_rows(routing, mb), share_prefix=share)
                sub_weights = None if is_weights is None else is_weights[rows]
                if on_policy:  # the on-policy fix: old = this very forward, detached (ratio == 1)
                    sub_old = log_prob.detach()
                if on_policy and sub_mask.any():
                    sub_weights, sub_mask, rc_metrics = rollout_correction(
                        old_log_prob=sub_old,
                        rollout_log_prob=sub.rollout_log_probs,
                        response_mask=sub_mask,
                        **rc_options,
                    )
                    for k, v in rc_metrics.items():
                        collected[k].append(v)
                elif not on_policy:
                    sub_old = old_log_prob[rows]
                agg = {"batch_num_tokens": num_tokens, "global_batch_size": num_rows}
                pg_loss, pg_metrics = policy_loss(
                    actor.policy_loss,
                    old_log_prob=sub_old,
                    log_prob=log_prob,
                    advantages=advantages[rows],
                    response_mask=sub_mask,
                    loss_agg_mode=actor.loss_agg_mode,
                    clip_ratio=actor.clip_ratio,
                    clip_ratio_low=actor.clip_ratio_low,
                    clip_ratio_high=actor.clip_ratio_high,
                    clip_ratio_c=actor.clip_ratio_c,
                    rollout_is_weights=sub_weights,
                    **agg,
                )
                loss = pg_loss
                entropy_loss = agg_loss(entropy, sub_mask, actor.loss_agg_mode, **agg)
                if actor.entropy_coeff:
                    loss = loss - actor.entropy_coeff * entropy_loss
                if ref_log_prob is not None:
                    kl = kl_penalty(log_prob, ref_log_prob[rows], actor.kl_loss_type)
                    kl_loss = agg_loss(kl, sub_mask, actor.loss_agg_mode, **agg)
                    loss = loss + actor.kl_loss_coef * kl_loss
                    collected["actor/kl_loss"].append(kl_loss.item())
                loss.backward()
                trained_tokens += int(sub.attention_mask.sum())
                # per-micro-batch partial sums; the mini-batch values are their sums (re-scaled below)
                collected["_pg_loss"].append(pg_loss.item())
                collected["_entropy"].append(entropy_loss.item())
                for k, v in pg_metrics.items():
                    collected[k].append(v)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, actor.grad_clip) if params else torch.tensor(0.0)
            if not torch.isfinite(grad_norm):
                collected["actor/nonfinite_grad_steps"].append(1.0)
            elif float(grad_norm) == 0.0:
                # no learning signal (e.g. every GRPO group scored alike): stepping Adam anyway would keep
                # moving the weights along its stale momentum, so the step is skipped
                collected["actor/zero_grad_steps_skipped"].append(1.0)
            else:
                optimizer.step()
            collected["actor/grad_norm"].append(distributed.full_value(grad_norm))
    timing["timing_s/update_actor"] = time.perf_counter() - t0
    n_steps = actor.ppo_epochs * actor.num_mini_batches
    pg_total = collected.pop("_pg_loss", [])
    ent_total = collected.pop("_entropy", [])
    kl_values = collected.pop("actor/kl_loss", [])
    metrics.update(_mean_metrics(collected))
    metrics["actor/pg_loss"] = sum(pg_total) / n_steps
    metrics["actor/entropy"] = sum(ent_total) / n_steps
    if kl_values:
        metrics["actor/kl_loss"] = sum(kl_values) / n_steps
    metrics["actor/lr"] = optimizer.param_groups[0]["lr"]
    metrics["actor/optimizer_steps"] = float(n_steps)
    metrics["perf/train_tokens_per_s"] = trained_tokens / max(timing["timing_s/update_actor"], 1e-9)
    metrics.update(timing)
    return metrics

