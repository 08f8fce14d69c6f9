"""One policy update on a collated rollout batch: old/ref log-probs, advantages, PPO mini-batches.

The algorithms are the pure functions of :mod:`agentrl.train.algorithms`; this module only wires them
to the model:

- advantages from ``algorithm.adv_estimator`` over the task groups, on the whole batch: under torchrun
  every rank's rows are gathered first (:func:`batch_advantages`), so whitened estimators (REINFORCE++,
  REINFORCE++-baseline) normalise over all ranks' tokens as verl does, whatever the number of GPUs;
- the step plan, made over all ranks' rows as one process would hold them (so the steps, their rows and
  their number do not depend on the number of ranks): rows without a model token are dropped, then
  ``actor.ppo_epochs`` x ``actor.num_mini_batches`` chunks are formed; under torchrun every rank runs as
  many micro-batches per step (and per no-grad pass) as the rank with the most, padding with an all-masked
  one, so FSDP's collectives stay in step whatever the ranks' row counts;
- the on-policy fix, decided on that plan: when it is exactly one optimizer step over all the rows,
  ``old_log_prob = log_prob.detach()`` of that very forward (ratio exactly 1); otherwise a separate no-grad
  pass computes ``old_log_prob`` first (logged as ``actor/on_policy``; ``actor.onpolicy_fix=false``
  always takes the separate pass);
- the loss is decoupled PPO (:func:`~agentrl.train.algorithms.decoupled_ppo_loss`): the ratio against
  ``old_log_prob`` (the proximal policy: the weights before this update), and the engine's log-probs (the
  behaviour policy, older weights too under asynchronous rollouts) corrected towards it by rollout correction
  (``algorithm.rollout_correction.*``), per micro-batch (weights and rejection masks are row-local, so this
  gives the values one pass over the whole batch would). Its ``rollout_corr/*``
  metrics, the rollout-vs-train gap included, are computed once over the whole batch (all ranks' rows
  that hold a model token);
- a micro-batch whose advantages are all 0 (GRPO's flat groups) runs its forward and loss but not its backward
  when the loss is the policy loss alone (:mod:`agentrl.train.backward_skip`): its gradient is exactly zero, so
  the weights, the metrics and the old log-probs are those of running it, to the bit;
- optional KL loss to a frozen reference model (for a LoRA policy, the policy itself with its adapters
  disabled: the base model without a second copy), optional entropy bonus, gradient accumulation over
  micro-batches;
- the policy loss's metrics over each step's tokens (:class:`_LossMetrics`): token-weighted means,
  ``*_max`` / ``*_min`` as the extremes, over all ranks; a micro-batch that rejection emptied adds nothing
  (no ``±inf``, no zeros pulling a mean down), and a batch without a trained token reports none.

Loss normalisation is verl's trainer's (``agg_loss`` with ``global_batch_info``): every micro-batch loss
is divided by totals of the whole optimizer step over all ranks and multiplied by the world size
(``dp_size``), so gradient accumulation and FSDP's averaging give the gradient of the step's loss, and the
rank-averaged logged losses are that loss (``token-sum`` included: it has no denominator, only ``dp_size``).
``seq-mean-token-sum-norm`` divides by ``actor.loss_scale_factor``, by default the batch's response width
over all ranks (one process's width of the concatenated batch). ``token-mean`` divides by the tokens left after rejection
sampling (verl's ``batch_num_tokens``, the sum of the rejected loss mask); the ``seq-mean-*`` modes divide
by every row of the mini-batch (verl's ``global_batch_size = ppo_mini_batch_size * rollout.n``), also a row
that rejection emptied, which adds 0 to the sum; ``token-sum`` divides by nothing. The rows of a
mini-batch are those of the step plan, i.e. rows that hold a model token before rejection. The token total after
rejection is not known before the on-policy path's forwards, so every micro-batch is aggregated with
the total before rejection and the gradients are multiplied by ``before / after`` after the last
backward. Both paths do exactly this, so the on-policy path with rejection gives the gradient of the
separate-pass path bit for bit, and both equal the gradient of verl's loss on the mini-batch.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from agentrl.models.lora import adapters_disabled, has_lora
from agentrl.models.routing import align_to_mask, replay_routing
from agentrl.train import distributed
from agentrl.train.algorithms import (
    agg_loss,
    compute_advantages,
    decoupled_ppo_loss,
    is_on_policy,
    kl_penalty,
    onpolicy_old_log_prob,
    rollout_correction,
)
from agentrl.train.backward_skip import record_zero_gradients, skip_allowed, zero_gradient
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


def replayed(model: Any, batch: Batch, routing: list[torch.Tensor] | None) -> Any:
    """Routing replay of ``routing`` (per row ``[L, n_i, k]``) for forwards over ``batch`` as
    :func:`forward_logprobs` lays it out; a no-op context for None. A training forward keeps it open until its
    backward is done: gradient checkpointing recomputes the layers, routers included, during the backward, and
    the recompute must route as the forward did (outside the context it would route naturally)."""
    if routing is None:
        return nullcontext()
    return replay_routing(model, align_to_mask(routing, _trimmed(batch)[1]))


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
    with replayed(model, batch, routing):
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


def _rank_micro_batches(rows: torch.Tensor, size: int) -> Iterator[tuple[torch.Tensor, bool]]:
    """``(rows, padding)`` per micro-batch of ``rows``; under torchrun every rank runs as many micro-batches as
    the rank with the most (FSDP's collectives in each forward and backward must stay in step), the extra
    ones being row 0 of the batch marked ``padding`` (their output is discarded, their loss is 0). The count is
    agreed on (a collective) before the first micro-batch: no other collective may come between."""
    chunks = [(mb, False) for mb in _micro_batches(rows, size)]
    padding = distributed.global_max(len(chunks)) - len(chunks)
    return iter(chunks + [(torch.zeros(1, dtype=torch.long), True)] * padding)


@torch.no_grad()
def batched_logprobs(model: Any, batch: Batch, *, micro_batch_size: int, chunk_size: int, temperature: float,
                     routing: list[torch.Tensor] | None = None, share_prefix: bool = False) -> torch.Tensor:
    """No-grad ``[B, R]`` log-probs over micro-batches (old-policy or reference pass)."""
    out = torch.zeros_like(batch.rollout_log_probs)
    rows = torch.arange(len(batch))
    for mb, padding in _rank_micro_batches(rows, micro_batch_size):
        lp, _ = forward_logprobs(model, batch.select(mb), chunk_size=chunk_size, temperature=temperature,
                                 compute_entropy=False, routing=_rows(routing, mb), share_prefix=share_prefix)
        if not padding:
            out[mb.to(out.device)] = lp
    return out


def _mean_metrics(collected: dict[str, list[float]]) -> dict[str, float]:
    return {k: sum(v) / len(v) for k, v in collected.items() if v}


class _LossMetrics:
    """The policy loss's metrics over an update: a key ending in ``_max`` (``_min``) is the largest
    (smallest) value of any micro-batch, every other key the mean weighted by the micro-batch's trained
    tokens, i.e. the value over all the update's tokens whatever the micro-batch size. Micro-batches
    without a token are not added; under torchrun :meth:`result` combines all ranks (same values on each)."""

    def __init__(self) -> None:
        self.weighted: dict[str, float] = defaultdict(float)
        self.tokens: dict[str, float] = defaultdict(float)
        self.extremes: dict[str, float] = {}

    def add(self, metrics: dict[str, float], tokens: float) -> None:
        if tokens <= 0:
            return
        for k, v in metrics.items():
            if k.endswith(("_max", "_min")):
                pick = max if k.endswith("_max") else min
                self.extremes[k] = pick(self.extremes.get(k, v), v)
            else:
                self.weighted[k] += v * tokens
                self.tokens[k] += tokens

    def result(self) -> dict[str, float]:
        parts = distributed.gather_objects([(dict(self.weighted), dict(self.tokens), self.extremes)])
        weighted: dict[str, float] = defaultdict(float)
        tokens: dict[str, float] = defaultdict(float)
        extremes: dict[str, float] = {}
        for w, n, e in parts:
            for k in w:
                weighted[k] += w[k]
                tokens[k] += n[k]
            for k, v in e.items():
                extremes[k] = (max if k.endswith("_max") else min)(extremes.get(k, v), v)
        return {**{k: weighted[k] / tokens[k] for k in sorted(weighted)}, **extremes}


def batch_advantages(batch: Batch, algo: Any) -> torch.Tensor:
    """``[B, R]`` advantages of ``batch``'s rows from ``algo.adv_estimator`` (``algo``: the config's
    ``algorithm`` section). Under torchrun the estimator runs on all ranks' rows, gathered in rank order
    (a group is keyed by its rank and its id), and each rank keeps its own rows: the result equals the
    single-process one on the concatenated batch, for the whitened estimators too."""
    rewards, mask, index = batch.token_level_rewards, batch.response_mask, batch.index
    start = 0
    if distributed.is_distributed():
        parts = distributed.gather_objects([(rewards.cpu(), mask.cpu(), index.cpu())])
        start = sum(len(p[2]) for p in parts[: distributed.rank()])
        width = max(p[0].shape[1] for p in parts)
        rewards, mask = (
            torch.cat([torch.nn.functional.pad(p[i], (0, width - p[i].shape[1])) for p in parts]) for i in range(2)
        )
        index = [(r, i) for r, p in enumerate(parts) for i in p[2].tolist()]
    advantages, _ = compute_advantages(
        algo.adv_estimator,
        token_level_rewards=rewards,
        response_mask=mask,
        index=index,
        gamma=algo.gamma,
        lam=algo.lam,
        norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo,
        epsilon=algo.epsilon,
    )
    local = advantages[start : start + len(batch), : batch.response_mask.shape[1]]
    return local.to(batch.response_mask.device)


def _global_rollout_metrics(
    old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, options: dict[str, Any]
) -> dict[str, float]:
    """``rollout_corr/*`` metrics over the whole batch's rows that hold a model token; under torchrun over
    all ranks' rows (every rank gets the same values, so averaging them over ranks changes nothing)."""
    if distributed.is_distributed():
        parts = distributed.gather_objects([(old.cpu(), rollout.cpu(), mask.cpu())])
        width = max(p[0].shape[1] for p in parts)
        old, rollout, mask = (
            torch.cat([torch.nn.functional.pad(p[i], (0, width - p[i].shape[1])) for p in parts])
            for i in range(3)
        )
    rows = mask.sum(-1) > 0  # an empty row (a failed episode kept for FSDP) is not a sample of the gap
    if not rows.any():
        return {}
    _, _, metrics = rollout_correction(old_log_prob=old[rows], rollout_log_prob=rollout[rows],
                                       response_mask=mask[rows], **options)
    return metrics


def _plan_steps(batch: Batch, cfg_actor: Any, generator: torch.Generator | None) -> list[torch.Tensor]:
    """This rank's row indices of each optimizer step (epochs x mini-batches). The plan is made over the whole
    batch, i.e. all ranks' rows in rank order as one process would hold them: rows without a model token
    dropped, a shuffle by ``generator`` (the same on every rank) when there are several mini-batches, chunks.
    So the steps, their rows and their number are those of one process on the concatenated batch, whatever
    the number of ranks; a step may hold no row of this rank (it then runs a padding micro-batch)."""
    usable = (batch.response_mask.sum(-1) > 0).cpu()
    parts = distributed.gather_objects([usable])
    offset = sum(len(p) for p in parts[: distributed.rank()])
    rows = torch.arange(sum(len(p) for p in parts))[torch.cat(parts)]
    steps: list[torch.Tensor] = []
    for _epoch in range(cfg_actor.ppo_epochs):
        order = torch.randperm(len(rows), generator=generator) if cfg_actor.num_mini_batches > 1 else None
        chosen = rows if order is None else rows[order]
        steps += list(chosen.chunk(cfg_actor.num_mini_batches)) if len(chosen) else []
    return [s[(s >= offset) & (s < offset + len(batch))] - offset for s in steps]


@dataclass
class Update:
    """What one policy update did: ``metrics`` (see :func:`run_update`) and ``old_log_prob``, the ``[B, R]``
    fp32 log-probs of the sampled tokens under the weights that sampled them (the old-policy log-probs the
    PPO ratio was taken against; 0 on env and padding tokens), or None when no optimizer step was planned."""

    metrics: dict[str, float]
    old_log_prob: torch.Tensor | None


@dataclass
class _Run:
    """The state one update shares between its steps (see :func:`run_update`)."""

    model: Any
    optimizer: torch.optim.Optimizer
    batch: Batch
    actor: Any
    temperature: float
    routing: list[torch.Tensor] | None
    rc_options: dict[str, Any]
    advantages: torch.Tensor
    on_policy: bool
    loss_scale_factor: float
    skip_backward: bool = False  # zero-advantage micro-batches may skip their backward (agentrl.train.backward_skip)
    old_log_prob: torch.Tensor | None = None  # the separate pass's, or (on-policy) filled step by step
    ref_log_prob: torch.Tensor | None = None
    collected: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    loss_metrics: _LossMetrics = field(default_factory=lambda: _LossMetrics())
    totals: dict[str, float] = field(default_factory=lambda: {"pg_loss": 0.0, "entropy": 0.0, "kl_loss": 0.0})
    counts: dict[str, int] = field(
        default_factory=lambda: {"optimizer_steps": 0, "zero_grad_steps_skipped": 0, "nonfinite_grad_steps_skipped": 0,
                                 "backward_skipped_micro_batches": 0}
    )
    timing: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    trained_tokens: int = 0

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def run_update(
    *,
    model: Any,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    cfg: Any,
    temperature: float,
    ref_model: Any | None = None,
    generator: torch.Generator | None = None,
    routing: list[torch.Tensor] | None = None,
) -> Update:
    """One policy update in small steps: advantages, the step plan and the on-policy decision, the separate
    old-policy and reference passes when needed, each planned optimizer step (see the module docstring) on
    ``batch`` (already on the model's device), the metrics: verl's names plus ``actor/optimizer_steps`` (steps
    taken), ``actor/zero_grad_steps_skipped`` and ``actor/nonfinite_grad_steps_skipped`` (steps whose gradient
    was all zero or not finite: no update), ``actor/backward_skipped_micro_batches`` (micro-batches whose
    backward was not run: advantage 0 on every token, :mod:`agentrl.train.backward_skip`; the weights, the other
    metrics and the old log-probs are to the bit those of running it). ``cfg`` is the full train config. ``ref_model``: the KL reference (with ``actor.use_kl_loss``): a
    frozen model, or ``model`` itself when it carries a LoRA adapter (its base model: adapters disabled for the
    reference pass). ``routing``: per-row rollout MoE routing to replay in every policy forward (routing
    replay), or None."""
    if ref_model is model and not has_lora(model):
        raise ValueError("ref_model is the policy itself but it carries no LoRA adapter: the KL would be 0; "
                         "pass a frozen copy as the reference")
    actor, algo = cfg.actor, cfg.algorithm
    rc = algo.rollout_correction
    steps = _plan_steps(batch, actor, generator)
    run = _Run(
        model=model, optimizer=optimizer, batch=batch, actor=actor, temperature=temperature, routing=routing,
        rc_options=dict(rollout_is=rc.rollout_is, rollout_is_threshold=rc.rollout_is_threshold,
                        rollout_rs=rc.rollout_rs, rollout_rs_threshold=rc.rollout_rs_threshold),
        advantages=batch_advantages(batch, algo),
        on_policy=bool(actor.onpolicy_fix) and is_on_policy(optimizer_steps=len(steps)),
        # seq-mean-token-sum-norm's divisor: the key, else the response width of the whole batch (all ranks)
        loss_scale_factor=float(actor.loss_scale_factor or distributed.global_max(batch.response_mask.shape[1])),
    )
    if steps:
        _old_policy_pass(run)
        _reference_pass(run, ref_model)
    run.skip_backward = skip_allowed(actor, has_reference=run.ref_log_prob is not None,
                                     distributed=distributed.is_distributed(), model=model)
    if run.on_policy:
        run.old_log_prob = torch.zeros_like(batch.rollout_log_probs)  # filled by each step's own forward
    t0 = time.perf_counter()
    for step_rows in steps:
        _optimizer_step(run, step_rows)
    run.timing["timing_s/update_actor"] = time.perf_counter() - t0
    return Update(_metrics(run, len(steps)), run.old_log_prob if steps else None)


def _no_grad_pass(run: _Run, model: Any, name: str, routing: list[torch.Tensor] | None) -> torch.Tensor:
    """``[B, R]`` log-probs of the batch under ``model`` without gradients, timed as ``timing_s/<name>``."""
    actor = run.actor
    t0 = time.perf_counter()
    out = batched_logprobs(model, run.batch, micro_batch_size=actor.micro_batch_size,
                           chunk_size=actor.logprob_chunk_size, temperature=run.temperature, routing=routing,
                           share_prefix=actor.share_prompt_prefix)
    run.timing[f"timing_s/{name}"] = time.perf_counter() - t0
    return out


def _old_policy_pass(run: _Run) -> None:
    """Off-policy: the separate no-grad old-log-prob pass (the proximal policy of the decoupled loss)."""
    if not run.on_policy:
        run.old_log_prob = _no_grad_pass(run, run.model, "old_log_prob", run.routing)


def _reference_pass(run: _Run, ref_model: Any | None) -> None:
    """The frozen reference's log-probs for the KL loss (when there is one). A LoRA policy's own base (its
    adapters disabled) runs in eval mode, as a separate reference copy does: a base whose config has dropout
    would otherwise give a random reference (and draw from the RNG the policy's forwards use)."""
    if ref_model is not None:
        if ref_model is run.model:
            with adapters_disabled(run.model), eval_mode(run.model):
                run.ref_log_prob = _no_grad_pass(run, ref_model, "ref", None)
        else:
            run.ref_log_prob = _no_grad_pass(run, ref_model, "ref", None)


@contextmanager
def eval_mode(model: Any) -> Iterator[Any]:
    """``model`` in eval mode (dropout off) inside the context; every submodule's own mode is restored on exit,
    also on error."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in modes:
            module.train(training)


def _optimizer_step(run: _Run, step_rows: torch.Tensor) -> None:
    """One planned optimizer step: the micro-batches' losses and backwards, token-mean's re-normalisation from the
    tokens before rollout correction to those after it, the clipped step (skipped on a zero or non-finite
    gradient)."""
    mask = run.batch.response_mask
    run.optimizer.zero_grad(set_to_none=True)
    pre = mask[step_rows.to(mask.device)]
    # totals of the whole step (all ranks) before rollout correction; dp_size: FSDP averages the ranks' gradients
    tokens_before = distributed.global_sum(pre.sum()).clamp(min=1)
    rows_before = distributed.global_sum((pre.sum(-1) > 0).sum()).clamp(min=1)
    agg = {"dp_size": distributed.world_size(), "batch_num_tokens": tokens_before, "global_batch_size": rows_before,
           "loss_scale_factor": run.loss_scale_factor}
    tokens_after = torch.zeros((), dtype=torch.float64, device=mask.device)
    partial = {"pg_loss": 0.0, "entropy": 0.0, "kl_loss": 0.0}
    for mb, padding in _rank_micro_batches(step_rows, run.actor.micro_batch_size):
        done = _micro_batch(run, mb, agg, padding=padding)
        if done is None:
            continue
        tokens_after += done.tokens
        if done.kl_loss is not None:
            partial["kl_loss"] += done.kl_loss
        partial["pg_loss"] += done.pg_loss
        partial["entropy"] += done.entropy
    # token-mean: re-normalise from the tokens before rejection to the tokens after it (the seq-mean modes
    # keep every row of the mini-batch, token-sum has no denominator)
    factor = 1.0
    if run.actor.loss_agg_mode == "token-mean":
        later = float(distributed.global_sum(tokens_after))
        factor = float(tokens_before) / later if later > 0 else 1.0
    if factor != 1.0:
        for p in run.params:
            if p.grad is not None:
                p.grad.mul_(factor)
    for k in run.totals:
        run.totals[k] += partial[k] * factor
    params = run.params
    grad_norm = torch.nn.utils.clip_grad_norm_(params, run.actor.grad_clip) if params else torch.tensor(0.0)
    if not torch.isfinite(grad_norm):
        run.counts["nonfinite_grad_steps_skipped"] += 1
    elif float(grad_norm) == 0.0:
        # no learning signal (e.g. every GRPO group scored alike): stepping Adam anyway would keep
        # moving the weights along its stale momentum, so the step is skipped
        run.counts["zero_grad_steps_skipped"] += 1
    else:
        run.optimizer.step()
        run.counts["optimizer_steps"] += 1
    run.collected["actor/grad_norm"].append(distributed.full_value(grad_norm))


@dataclass
class _MicroBatchLoss:
    """What one micro-batch's backward added to its step: ``tokens`` (its loss tokens after rollout correction)
    and the ``.item()`` of its policy loss, entropy and (with a reference) KL loss."""

    tokens: torch.Tensor
    pg_loss: float
    entropy: float
    kl_loss: float | None


def _micro_batch(run: _Run, mb: torch.Tensor, agg: dict[str, Any], *, padding: bool = False) -> _MicroBatchLoss | None:
    """Forward, loss and backward of one micro-batch of a step (None when it has no loss token and runs alone);
    a ``padding`` one (torchrun: FSDP's collectives in step) has an all-zero loss mask and records nothing.
    Routing replay stays on through the backward: gradient checkpointing re-runs the routers there."""
    mask = run.batch.response_mask
    if not mask[mb.to(mask.device)].any() and not distributed.is_distributed():  # ranks keep FSDP collectives in step
        return None
    sub = run.batch.select(mb)
    with replayed(run.model, sub, _rows(run.routing, mb)):
        return _micro_batch_loss(run, mb, sub, agg, padding)


def _micro_batch_loss(run: _Run, mb: torch.Tensor, sub: Batch, agg: dict[str, Any], padding: bool) -> _MicroBatchLoss:
    """:func:`_micro_batch`'s loss and backward; it records into ``run`` what the whole update reports (the
    on-policy old log-probs, trained tokens, the policy loss's metrics)."""
    actor, mask = run.actor, run.batch.response_mask
    rows = mb.to(mask.device)
    sub_mask = torch.zeros_like(mask[rows]) if padding else mask[rows]
    log_prob, entropy = forward_logprobs(run.model, sub, chunk_size=actor.logprob_chunk_size,
                                         temperature=run.temperature, compute_entropy=True,
                                         share_prefix=actor.share_prompt_prefix and run.routing is None)
    if run.on_policy:  # the on-policy fix: old = this very forward, detached (ratio == 1)
        sub_old = onpolicy_old_log_prob(log_prob, optimizer_steps=1)
        if not padding:
            run.old_log_prob[rows] = sub_old
    else:
        sub_old = run.old_log_prob[rows]
    mode = actor.loss_agg_mode
    # decoupled PPO: the ratio against old (the proximal policy), the rollout's log-probs corrected towards it
    # (row-local weights and rejection: the same values per micro-batch as over the whole batch)
    pg_loss, pg_metrics, sub_mask = decoupled_ppo_loss(
        actor.policy_loss, behaviour_log_prob=sub.rollout_log_probs, proximal_log_prob=sub_old, log_prob=log_prob,
        advantages=run.advantages[rows], response_mask=sub_mask, gap_metrics=False, **run.rc_options,
        loss_agg_mode=mode, clip_ratio=actor.clip_ratio, clip_ratio_low=actor.clip_ratio_low,
        clip_ratio_high=actor.clip_ratio_high, clip_ratio_c=actor.clip_ratio_c, **agg,
    )
    sub_tokens = sub_mask.sum()
    loss = pg_loss
    entropy_loss = agg_loss(entropy, sub_mask, mode, **agg)
    if actor.entropy_coeff:
        loss = loss - actor.entropy_coeff * entropy_loss
    kl_value = None
    if run.ref_log_prob is not None:
        kl_loss = agg_loss(kl_penalty(log_prob, run.ref_log_prob[rows], actor.kl_loss_type), sub_mask, mode, **agg)
        loss = loss + actor.kl_loss_coef * kl_loss
        kl_value = kl_loss.item()
    if _backward_skipped(run, rows, sub_mask, padding, log_prob, entropy, loss):
        run.counts["backward_skipped_micro_batches"] += 1
    else:
        loss.backward()
    run.trained_tokens += 0 if padding else int(sub.attention_mask.sum())
    run.loss_metrics.add(pg_metrics, float(sub_tokens))
    return _MicroBatchLoss(sub_tokens, pg_loss.item(), entropy_loss.item(), kl_value)


def _backward_skipped(run: _Run, rows: torch.Tensor, loss_mask: torch.Tensor, padding: bool, *forward: torch.Tensor | None
                      ) -> bool:
    """Whether the micro-batch of ``rows`` skips its backward: allowed for this update, advantage 0 on its whole
    ``loss_mask`` and a finite ``forward`` (:mod:`agentrl.train.backward_skip`); then the zero gradients the
    backward would have written are recorded."""
    if not run.skip_backward or padding or not zero_gradient(run.advantages[rows], loss_mask, *forward):
        return False
    return record_zero_gradients(forward[-1], run.params)


def _metrics(run: _Run, n_steps: int) -> dict[str, float]:
    """The update's metrics: rollout-correction gap metrics over the whole batch, the means of what the
    steps collected, losses, counts, throughput and timings."""
    metrics: dict[str, float] = {"actor/on_policy": float(run.on_policy)}
    if n_steps:
        metrics.update(_global_rollout_metrics(run.old_log_prob, run.batch.rollout_log_probs,
                                               run.batch.response_mask, run.rc_options))
    metrics.update(run.loss_metrics.result())
    metrics.update(_mean_metrics(run.collected))
    steps = max(n_steps, 1)
    metrics["actor/pg_loss"] = run.totals["pg_loss"] / steps
    metrics["actor/entropy"] = run.totals["entropy"] / steps
    if run.ref_log_prob is not None:
        metrics["actor/kl_loss"] = run.totals["kl_loss"] / steps
    metrics["actor/lr"] = run.optimizer.param_groups[0]["lr"]
    metrics.update({f"actor/{k}": float(v) for k, v in run.counts.items()})
    metrics["perf/train_tokens_per_s"] = run.trained_tokens / max(run.timing["timing_s/update_actor"], 1e-9)
    metrics.update(run.timing)
    return metrics
