"""run_update at its edges (those listed below), against verl 0.9.1's loss on the same mini-batch.

- Loss denominators after rejection sampling: the step's gradient equals the gradient of verl's policy
  loss (``vanilla``) on the step's rows with verl's trainer's ``global_batch_info``: ``batch_num_tokens``
  the tokens left after rejection, ``global_batch_size`` every row of the mini-batch (rows that rejection
  emptied included), for every aggregation mode, micro-batch size, rejection option, on- and off-policy
  path, one or two mini-batches.
- Ratio metrics: micro-batches emptied by rejection add nothing; the step's metrics are those of the
  policy loss over all the step's tokens (verl's function on the whole batch), never ``±inf``.
- ``algorithm.epsilon=0``: a constant group costs no NaN and no skipped step.
"""

from __future__ import annotations

import math

import pytest
import torch
from _profiles import examples
from _tiny_llama import tiny_llama
from _tiny_update import ragged_batch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_algos_properties import logprob_cases

from agentrl.train import algorithms as A
from agentrl.train.batch import Batch
from agentrl.train.config import build_config
from agentrl.train.update import _LossMetrics, _plan_steps, batched_logprobs, forward_logprobs, run_update

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl is not installed")
rch = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper", reason="verl is not installed")
from verl.workers.config.actor import ActorConfig  # noqa: E402

REJECTIONS = [
    ("token_k1", "0.5_2.0"),
    ("seq_max_k2,token_k1", "8.0,0.5_2.0"),
    ("seq_mean_k3", "0.3"),
    ("seq_sum_k1", "0.5_2.0"),
    ("token_k2", "1.0"),
]
MODEL = tiny_llama()


@st.composite
def update_cases(draw):
    n = draw(st.integers(2, 8))
    return dict(
        n=n,
        seed=draw(st.integers(0, 2**16)),
        mode=draw(st.sampled_from(A.LOSS_AGG_MODES)),
        micro=draw(st.sampled_from([1, 2, 3, 64])),
        rejection=draw(st.sampled_from(REJECTIONS)),
        rollout_is=draw(st.sampled_from([None, "token", "sequence"])),
        onpolicy_fix=draw(st.booleans()),
        mini_batches=draw(st.sampled_from([1, 1, 2])),
        off_fraction=draw(st.sampled_from([0.0, 0.3, 1.0])),
        rejected_rows=draw(st.lists(st.integers(0, n - 1), max_size=n, unique=True)),
    )


def _batch_with_gaps(case) -> Batch:
    """A ragged batch whose rollout log-probs are the model's own, with some tokens 2 nats off and the
    ``rejected_rows`` 5 nats off on every token (those rows fall to most rejection options)."""
    batch = ragged_batch(case["n"], seed=case["seed"])
    lp = batched_logprobs(MODEL, batch, micro_batch_size=64, chunk_size=1024, temperature=1.0)
    g = torch.Generator().manual_seed(case["seed"])
    off = (torch.rand(lp.shape, generator=g) < case["off_fraction"]) & batch.response_mask.bool()
    roll = lp - 2.0 * off
    for row in case["rejected_rows"]:
        roll[row] = lp[row] - 5.0
    batch.rollout_log_probs = roll * batch.response_mask
    return batch


def _config(case):
    rs, threshold = case["rejection"]
    extra = [f"algorithm.rollout_correction.rollout_rs={rs}",
             f"algorithm.rollout_correction.rollout_rs_threshold='{threshold}'",
             f"actor.loss_agg_mode={case['mode']}", f"actor.micro_batch_size={case['micro']}",
             f"actor.onpolicy_fix={str(case['onpolicy_fix']).lower()}", f"actor.num_mini_batches={case['mini_batches']}",
             "actor.grad_clip=1e9", "actor.share_prompt_prefix=false"]
    if case["rollout_is"]:
        extra.append(f"algorithm.rollout_correction.rollout_is={case['rollout_is']}")
    return build_config(["env=retool", *extra])


def _verl_step_gradient(batch: Batch, rows: torch.Tensor, cfg) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Gradient of verl's vanilla loss on the mini-batch ``rows``, with verl's trainer's global batch info;
    and the mini-batch's rejected mask."""
    rc = cfg.algorithm.rollout_correction
    MODEL.zero_grad()
    sub = batch.select(rows)
    log_prob, _ = forward_logprobs(MODEL, sub, chunk_size=1024, temperature=1.0, compute_entropy=False)
    proto, mask, _ = rch.compute_rollout_correction_and_rejection_mask(
        log_prob.detach(), sub.rollout_log_probs, sub.response_mask, rollout_is=rc.rollout_is,
        rollout_is_threshold=rc.rollout_is_threshold, rollout_rs=rc.rollout_rs,
        rollout_rs_threshold=rc.rollout_rs_threshold)
    advantages, _ = A.compute_advantages("grpo", token_level_rewards=batch.token_level_rewards,
                                         response_mask=batch.response_mask, index=batch.index)
    info = {"dp_size": 1, "batch_num_tokens": mask.sum().item(), "global_batch_size": len(rows),
            "loss_scale_factor": None}
    actor = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1, global_batch_info=info)
    weights = None if proto is None else proto.batch["rollout_is_weights"]
    if mask.any():
        loss, _ = core_algos.get_policy_loss_fn("vanilla")(log_prob.detach(), log_prob, advantages[rows], mask,
                                                           cfg.actor.loss_agg_mode, actor, weights)
        loss.backward()
    return {k: torch.zeros_like(p) if p.grad is None else p.grad.clone() for k, p in MODEL.named_parameters()}, mask


def _check_update(case):
    cfg = _config(case)
    batch = _batch_with_gaps(case)
    m = run_update(model=MODEL, optimizer=torch.optim.SGD(MODEL.parameters(), lr=0.0), batch=batch, cfg=cfg,
                   temperature=1.0, generator=torch.Generator().manual_seed(case["seed"])).metrics
    ours = {k: torch.zeros_like(p) if p.grad is None else p.grad.clone() for k, p in MODEL.named_parameters()}
    steps = _plan_steps(batch, cfg.actor, torch.Generator().manual_seed(case["seed"]))
    theirs, last_mask = _verl_step_gradient(batch, steps[-1], cfg)  # the gradient left is the last step's
    scale = max(float(g.abs().max()) for g in theirs.values()) + 1e-12
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-5, atol=1e-6 * scale, msg=k)
    assert all(math.isfinite(v) for v in m.values()), m
    ratio_keys = {"actor/ppo_ratio_mean", "actor/ppo_ratio_max", "actor/ppo_ratio_min"}
    lp = batched_logprobs(MODEL, batch, micro_batch_size=64, chunk_size=1024, temperature=1.0)
    rc = cfg.algorithm.rollout_correction
    _, trained, _ = A.rollout_correction(old_log_prob=lp, rollout_log_prob=batch.rollout_log_probs,
                                         response_mask=batch.response_mask, rollout_rs=rc.rollout_rs,
                                         rollout_rs_threshold=rc.rollout_rs_threshold)
    if trained.any():  # every real ratio is 1 (lr 0: old and new log-probs are one model's)
        for k in ratio_keys:
            assert m[k] == pytest.approx(1.0, abs=1e-5), (k, m[k])
        assert m["actor/pg_clipfrac"] == pytest.approx(0.0, abs=1e-6)
    else:  # rejection emptied the whole batch: no ratio was seen, none is reported
        assert not ratio_keys & set(m) and "actor/pg_clipfrac" not in m
    assert bool(last_mask.any()) or all((g == 0).all() for g in ours.values())


@settings(max_examples=examples(15))  # a model update each: ~0.3 s on a quiet core
@given(case=update_cases())
def test_update_gradient_equals_verls_loss_on_the_mini_batch(case):
    _check_update(case)



def test_seq_mean_divides_by_every_row_after_rejection_empties_one():
    """The issue's case: one row of two rejected whole; seq-mean-token-mean gave twice verl's gradient."""
    case = dict(n=2, seed=3, mode="seq-mean-token-mean", micro=64, rejection=("seq_max_k2,token_k1", "8.0,0.5_2.0"),
                rollout_is=None, onpolicy_fix=True, mini_batches=1, off_fraction=0.0, rejected_rows=[1])
    _check_update(case)


# ---------------------------------------------------------------------------- the metrics' aggregation
def _check_loss_metrics(case, name, cuts, emptied):
    mask = case["mask"]
    b = mask.shape[0]
    mask = mask.clone()
    mask[[r for r in emptied if r < b]] = 0  # rows rejection emptied (maybe every row of a micro-batch)
    kw = dict(old_log_prob=case["old"], log_prob=case["other"], advantages=case["adv"])
    acc = _LossMetrics()
    bounds = sorted({0, b, *(c for c in cuts if c < b)})
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        _, metrics = A.policy_loss(name, **{k: v[lo:hi] for k, v in kw.items()}, response_mask=mask[lo:hi])
        acc.add(metrics, float(mask[lo:hi].sum()))
    result = acc.result()
    assert all(math.isfinite(v) for v in result.values())
    if not mask.any():
        assert result == {}
        return
    _, whole = A.policy_loss(name, **kw, response_mask=mask)
    assert result.keys() == whole.keys()
    for k, v in whole.items():
        assert result[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    cfg = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1)
    _, verl_whole = core_algos.get_policy_loss_fn(name)(case["old"], case["other"], case["adv"], mask, "token-mean",
                                                        cfg, None)
    for k, v in verl_whole.items():
        assert result[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


LOSS_METRIC_INPUTS = given(
    case=logprob_cases(need_token=False), name=st.sampled_from(sorted(A.POLICY_LOSSES)),
    cuts=st.lists(st.integers(1, 16), max_size=5), emptied=st.lists(st.integers(0, 16), max_size=17),
)


@LOSS_METRIC_INPUTS
def test_step_metrics_are_the_policy_loss_metrics_over_all_tokens(case, name, cuts, emptied):
    _check_loss_metrics(case, name, cuts, emptied)



# ---------------------------------------------------------------------------- epsilon = 0
def test_epsilon_zero_with_a_constant_group_takes_the_step():
    batch = ragged_batch(6, seed=1)
    batch.token_level_rewards[:3] = 0.0
    batch.token_level_rewards[:3, 0] = 1.0  # group 0 scores 1, 1, 1; group 1 varies
    grads = {}
    for eps in (0.0, 1e-6):
        cfg = build_config(["env=retool", "actor.grad_clip=1e9", f"algorithm.epsilon={eps}"])
        m = run_update(model=MODEL, optimizer=torch.optim.SGD(MODEL.parameters(), lr=0.0), batch=batch, cfg=cfg,
                       temperature=1.0).metrics
        assert m["actor/optimizer_steps"] == 1.0 and m["actor/nonfinite_grad_steps_skipped"] == 0.0
        grads[eps] = {k: p.grad.clone() for k, p in MODEL.named_parameters()}
    for k in grads[0.0]:
        assert torch.isfinite(grads[0.0][k]).all()
        torch.testing.assert_close(grads[0.0][k], grads[1e-6][k], rtol=1e-4, atol=1e-9)
