"""run_update on a tiny model: what actually runs decides the on-policy fix, rejection sampling in the
on-policy path gives the separate pass's gradient (and verl's), metrics over the whole batch, extreme gaps
complete, and a batch without learning signal leaves the weights (and Adam state) untouched."""

from __future__ import annotations

import math

import pytest
import torch
from _tiny_llama import tiny_llama as _model
from _tiny_update import ragged_batch as _ragged_batch

from agentrl.harmony.trajectory import Trajectory
from agentrl.train.algorithms import rollout_correction
from agentrl.train.batch import collate
from agentrl.train.config import build_config
from agentrl.train.update import batched_logprobs, forward_logprobs, run_update


def _batch(rewards, groups=None):
    trajs = [Trajectory(prompt_ids=[1, 2, 3], response_ids=[4 + i, 5], response_mask=[1, 1],
                        rollout_logprobs=[-1.0, -1.0], reward=r) for i, r in enumerate(rewards)]
    return collate(trajs, groups or [0] * len(trajs))


def _cfg(*extra: str):
    return build_config(["env=retool", "actor.grad_clip=1e9", *extra])


def _grads(model) -> dict[str, torch.Tensor]:
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def _frozen_optimizer(model):
    """SGD at lr 0: the gradients stay readable after run_update and the weights do not move."""
    return torch.optim.SGD(model.parameters(), lr=0.0)


# ---------------------------------------------------------------------------- the step plan decides
def test_zero_signal_skips_the_optimizer_step():
    cfg = build_config(["env=retool"])
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    m = run_update(model=model, optimizer=opt, batch=_batch([1.0, 0.0]), cfg=cfg, temperature=1.0).metrics
    assert m["actor/grad_norm"] > 0 and m["actor/zero_grad_steps_skipped"] == 0.0
    assert m["actor/optimizer_steps"] == 1.0
    after_real_step = {k: v.detach().clone() for k, v in model.named_parameters()}
    m = run_update(model=model, optimizer=opt, batch=_batch([1.0, 1.0]), cfg=cfg, temperature=1.0).metrics
    assert m["actor/grad_norm"] == 0.0 and m["actor/zero_grad_steps_skipped"] == 1.0
    assert m["actor/optimizer_steps"] == 0.0  # a skipped step is not a step taken
    for k, v in model.named_parameters():  # Adam's momentum would have moved them
        assert torch.equal(v, after_real_step[k]), k


def _one_usable_row_batch():
    """Two rows, one of them without a model token (e.g. the env failed at reset)."""
    trajs = [
        Trajectory(prompt_ids=[1, 2, 3], response_ids=[7, 8, 9], response_mask=[1, 1, 1],
                   rollout_logprobs=[-1.0, -2.0, -3.0], reward=1.0),
        Trajectory(prompt_ids=[1, 2], response_ids=[4, 5], response_mask=[0, 0], rollout_logprobs=[0.0, 0.0],
                   reward=0.0),
    ]
    return collate(trajs, [0, 1])


@pytest.mark.parametrize("extra, on_policy, steps", [
    (["actor.num_mini_batches=2"], True, 1),  # 2 mini-batches configured, 1 usable row: one step
    (["actor.num_mini_batches=4"], True, 1),  # chunking 1 row into 4 parts yields one chunk
    (["actor.ppo_epochs=2", "actor.num_mini_batches=2"], False, 2),  # two epochs: two steps
    (["actor.onpolicy_fix=false"], False, 1),  # the fix switched off: separate pass, one step
])
def test_on_policy_is_decided_by_the_steps_that_run(extra, on_policy, steps):
    model = _model()
    m = run_update(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                   batch=_one_usable_row_batch(), cfg=_cfg(*extra), temperature=1.0).metrics
    assert m["actor/on_policy"] == float(on_policy)
    assert m["actor/optimizer_steps"] == float(steps)
    assert ("timing_s/old_log_prob" in m) == (not on_policy)  # the separate pass ran only off-policy
    if on_policy:
        assert m["actor/ppo_ratio_max"] == 1.0 and m["actor/ppo_ratio_min"] == 1.0
        assert m["actor/pg_clipfrac"] == 0.0 and m["actor/ppo_kl"] == 0.0


def test_chunking_into_several_steps_is_off_policy():
    batch = _ragged_batch(3)
    model = _model()
    m = run_update(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), batch=batch,
                   cfg=_cfg("actor.num_mini_batches=2", "actor.micro_batch_size=1"), temperature=1.0,
                   generator=torch.Generator().manual_seed(0)).metrics
    assert m["actor/on_policy"] == 0.0 and m["actor/optimizer_steps"] == 2.0  # chunks of 2 and 1 rows


# ---------------------------------------------------------------------------- rejection, on-policy
REJECTION = [
    "algorithm.rollout_correction.rollout_rs=token_k1",
    "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0",
]
SEQ_REJECTION = [
    "algorithm.rollout_correction.rollout_rs=seq_max_k2,token_k1",
    "algorithm.rollout_correction.rollout_rs_threshold='8.0,0.5_2.0'",
    "algorithm.rollout_correction.rollout_is=token",
]


def _with_gaps(model, batch, cfg):
    """Rollout log-probs = the model's own, but some tokens 2 nats off (token rejection) and one row with a
    5-nat token (its seq_max_k2 is 12.5: the whole row is rejected under SEQ_REJECTION)."""
    lp = batched_logprobs(model, batch, micro_batch_size=64, chunk_size=1024, temperature=1.0)
    roll = lp.clone()
    g = torch.Generator().manual_seed(1)
    off = (torch.rand(lp.shape, generator=g) < 0.3) & batch.response_mask.bool()
    roll[off] -= 2.0
    first = batch.response_mask[1].nonzero()[0, 0]
    roll[1, first] -= 5.0
    batch.rollout_log_probs = roll * batch.response_mask
    return batch


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum"])
@pytest.mark.parametrize("rs", [REJECTION, SEQ_REJECTION], ids=["token_k1", "seq_max_k2+token_k1+IS"])
def test_rejection_on_policy_gradient_equals_the_separate_pass(mode, rs):
    """Rejection on, micro-batches of 2 over 7 rows: the on-policy path (which only learns the rejection
    from each micro-batch's own forward) gives the separate-pass path's gradient bit for bit."""
    model = _model()
    cfg = _cfg(*rs, f"actor.loss_agg_mode={mode}", "actor.micro_batch_size=2", "actor.share_prompt_prefix=false")
    batch = _with_gaps(model, _ragged_batch(7), cfg)
    m_on = run_update(model=model, optimizer=_frozen_optimizer(model), batch=batch, cfg=cfg, temperature=1.0).metrics
    g_on = _grads(model)
    off_cfg = _cfg(*rs, f"actor.loss_agg_mode={mode}", "actor.micro_batch_size=2",
                   "actor.share_prompt_prefix=false", "actor.onpolicy_fix=false")
    m_off = run_update(model=model, optimizer=_frozen_optimizer(model), batch=batch, cfg=off_cfg, temperature=1.0).metrics
    g_off = _grads(model)
    assert m_on["actor/on_policy"] == 1.0 and m_off["actor/on_policy"] == 0.0
    assert 0 < m_on["rollout_corr/rollout_rs_masked_fraction"] < 1  # the rejection really rejects
    assert g_on.keys() == g_off.keys() and any(g.abs().sum() > 0 for g in g_on.values())
    for k in g_on:
        assert torch.equal(g_on[k], g_off[k]), k
    for k, v in m_off.items():  # the whole-batch rollout_corr metrics agree too
        if k.startswith("rollout_corr/"):
            assert m_on[k] == pytest.approx(v, rel=1e-6, abs=1e-7), k


def test_rejection_gradient_equals_verls_loss_on_the_post_rejection_mask():
    """The on-policy step's gradient is the gradient of verl's vanilla loss on the whole batch, with
    old_log_prob = log_prob.detach() and verl's rejection mask and IS weights: the token total in the
    denominator is the post-rejection one, although no micro-batch knows it when it runs."""
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    rch = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
    from verl.workers.config.actor import ActorConfig

    model = _model()
    cfg = _cfg(*SEQ_REJECTION, "actor.micro_batch_size=2", "actor.share_prompt_prefix=false")
    batch = _with_gaps(model, _ragged_batch(7), cfg)
    run_update(model=model, optimizer=_frozen_optimizer(model), batch=batch, cfg=cfg, temperature=1.0)
    ours = _grads(model)

    from agentrl.train.algorithms import compute_advantages

    model.zero_grad()
    log_prob, _ = forward_logprobs(model, batch, chunk_size=1024, temperature=1.0, compute_entropy=False)
    rc = cfg.algorithm.rollout_correction
    proto, new_mask, _ = rch.compute_rollout_correction_and_rejection_mask(
        log_prob.detach(), batch.rollout_log_probs, batch.response_mask, rollout_is=rc.rollout_is,
        rollout_is_threshold=rc.rollout_is_threshold, rollout_rs=rc.rollout_rs,
        rollout_rs_threshold=rc.rollout_rs_threshold)
    adv, _ = compute_advantages("grpo", token_level_rewards=batch.token_level_rewards,
                                response_mask=batch.response_mask, index=batch.index)
    actor = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1)
    loss, _ = core_algos.get_policy_loss_fn("vanilla")(log_prob.detach(), log_prob, adv, new_mask, "token-mean",
                                                       actor, proto.batch["rollout_is_weights"])
    loss.backward()
    assert new_mask.sum() < batch.response_mask.sum() and new_mask[1].sum() == 0  # row 1 rejected whole
    for k, p in model.named_parameters():
        torch.testing.assert_close(ours[k], p.grad, rtol=1e-5, atol=1e-7)


def test_rollout_metrics_are_over_the_whole_batch_not_averaged_over_micro_batches():
    model = _model()
    cfg = _cfg(*SEQ_REJECTION, "actor.micro_batch_size=1")
    batch = _with_gaps(model, _ragged_batch(6), cfg)
    m = run_update(model=model, optimizer=_frozen_optimizer(model), batch=batch, cfg=cfg, temperature=1.0).metrics
    lp = batched_logprobs(model, batch, micro_batch_size=64, chunk_size=1024, temperature=1.0)
    rc = cfg.algorithm.rollout_correction
    _, _, whole = rollout_correction(old_log_prob=lp, rollout_log_prob=batch.rollout_log_probs,
                                     response_mask=batch.response_mask, rollout_is=rc.rollout_is,
                                     rollout_rs=rc.rollout_rs, rollout_rs_threshold=rc.rollout_rs_threshold)
    assert whole["rollout_corr/logprob_abs_diff_max"] == pytest.approx(5.0, abs=1e-4)
    for k, v in whole.items():
        assert m[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    # one row per micro-batch: an average of per-row maxima would be far below the batch maximum
    per_row = []
    for i in range(len(batch)):
        _, _, r = rollout_correction(old_log_prob=lp[i : i + 1], rollout_log_prob=batch.rollout_log_probs[i : i + 1],
                                     response_mask=batch.response_mask[i : i + 1])
        per_row.append(r["rollout_corr/logprob_abs_diff_max"])
    assert sum(per_row) / len(per_row) < 0.9 * m["rollout_corr/logprob_abs_diff_max"]


# ---------------------------------------------------------------------------- extreme gaps complete
@pytest.mark.parametrize("extra", [
    [],
    ["algorithm.rollout_correction.rollout_is=sequence", "algorithm.rollout_correction.rollout_is_threshold=2.0"],
    ["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold='0.5_2.0'",
     "algorithm.rollout_correction.rollout_rs=seq_sum_k3,token_k1",
     "algorithm.rollout_correction.rollout_rs_threshold='0.1,0.5_2.0'"],
    ["algorithm.rollout_correction.rollout_is=sequence", "actor.ppo_epochs=2"],
])
def test_a_step_with_one_extreme_token_completes(extra):
    model = _model()
    batch = _ragged_batch(5)
    lp = batched_logprobs(model, batch, micro_batch_size=64, chunk_size=1024, temperature=1.0)
    roll = torch.where(batch.response_mask.bool(), lp, torch.tensor(float("nan")))  # junk outside the mask
    roll[0, 0] = lp[0, 0] - 1e4  # one token 10^4 nats off
    batch.rollout_log_probs = roll
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    m = run_update(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), batch=batch,
                   cfg=_cfg("actor.micro_batch_size=2", *extra), temperature=1.0).metrics
    assert math.isfinite(m["actor/grad_norm"]) and m["actor/optimizer_steps"] >= 1
    assert m["rollout_corr/logprob_abs_diff_max"] == pytest.approx(1e4, rel=1e-3)
    assert math.isinf(m["rollout_corr/k3_kl"])  # saturates like verl's
    assert all(torch.isfinite(v).all() for v in model.parameters())
    assert any(not torch.equal(before[k], v) for k, v in model.named_parameters())
