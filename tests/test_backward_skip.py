"""Skipping the backward of zero-advantage micro-batches (agentrl.train.backward_skip) changes nothing: the
weights, the optimizer state, the metrics and the old log-probs after an update are those of running every
backward, to the bit; and the skip is off wherever the loss has a term besides the policy loss."""

from __future__ import annotations

import pytest
import torch
from _tiny_llama import tiny_llama

from agentrl.harmony.trajectory import Trajectory
from agentrl.train.backward_skip import record_zero_gradients
from agentrl.train.batch import collate
from agentrl.train.config import build_config
from agentrl.train.update import run_update

SKIPPED = "actor/backward_skipped_micro_batches"


def _mixed_batch(rewards_per_group: list[list[float]]):
    """One group per entry, ragged rows (an env observation inside the longer responses); a group whose rewards
    are all equal has advantage exactly 0 (a flat group)."""
    g = torch.Generator().manual_seed(0)
    trajs, groups = [], []
    for group, rewards in enumerate(rewards_per_group):
        for r in rewards:
            length = int(torch.randint(3, 9, (1,), generator=g))
            mask = [1] * length
            if length > 5:
                mask[2] = mask[3] = 0
            prompt = torch.randint(6, 100, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
            trajs.append(Trajectory(prompt_ids=prompt, response_ids=torch.randint(6, 100, (length,), generator=g).tolist(),
                                    response_mask=mask, rollout_logprobs=[-4.0] * length, reward=r))
            groups.append(group)
    return collate(trajs, groups)


def _update(batch, *overrides: str, ref: bool = False):
    """One run_update of a fresh tiny model with AdamW (weight decay on); returns the model, the optimizer's
    state, the update's metrics and old log-probs."""
    cfg = build_config(["env=retool", "actor.micro_batch_size=2", "actor.weight_decay=0.1", *overrides])
    model = tiny_llama(layers=2)
    ref_model = tiny_llama(seed=1, layers=2) if ref else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    update = run_update(model=model, optimizer=optimizer, batch=batch, cfg=cfg, temperature=1.0, ref_model=ref_model,
                        generator=torch.Generator().manual_seed(0))
    return model, optimizer.state_dict()["state"], update.metrics, update.old_log_prob


def _same_update(on, off):
    model_on, state_on, metrics_on, old_on = on
    model_off, state_off, metrics_off, old_off = off
    for (name, p_on), p_off in zip(model_on.named_parameters(), model_off.parameters(), strict=True):
        assert torch.equal(p_on, p_off), name
    assert state_on.keys() == state_off.keys()
    for k in state_on:
        for field in state_on[k]:
            assert torch.equal(torch.as_tensor(state_on[k][field]), torch.as_tensor(state_off[k][field])), (k, field)
    assert (old_on is None) == (old_off is None)
    if old_on is not None:
        assert torch.equal(old_on, old_off)
    ignored = {SKIPPED, "perf/train_tokens_per_s"}
    keep = {k for k in metrics_on if not k.startswith("timing_s/") and k not in ignored}
    assert keep == {k for k in metrics_off if not k.startswith("timing_s/") and k not in ignored}
    assert {k: metrics_on[k] for k in keep} == {k: metrics_off[k] for k in keep}


# flat groups first, in the middle and last; micro-batches of 2 rows = one group each
MIXED = [[1.0, 1.0], [1.0, 0.0], [0.0, 0.0], [0.3, 0.9], [0.5, 0.5]]


@pytest.mark.parametrize("extra", [
    [],  # on-policy: one step, old log-probs from the training forwards
    ["actor.gradient_checkpointing=true"],
    ["actor.num_mini_batches=2", "actor.ppo_epochs=2"],  # off-policy: separate old-log-prob pass, 4 steps
    ["actor.loss_agg_mode=seq-mean-token-mean", "actor.policy_loss=gspo"],
    ["actor.policy_loss=cispo", "actor.loss_agg_mode=token-sum"],
    ["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_rs=token_k1",
     "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0"],
])
def test_skipping_zero_advantage_backwards_is_bit_identical(extra):
    on = _update(_mixed_batch(MIXED), *extra)
    off = _update(_mixed_batch(MIXED), *extra, "actor.skip_zero_advantage_backward=false")
    assert on[2][SKIPPED] >= 3 and off[2][SKIPPED] == 0  # the three flat groups (in every epoch)
    assert on[2]["actor/optimizer_steps"] >= 1
    _same_update(on, off)


def test_an_all_flat_batch_skips_every_backward_and_the_step():
    on = _update(_mixed_batch([[1.0, 1.0], [0.0, 0.0]]))
    off = _update(_mixed_batch([[1.0, 1.0], [0.0, 0.0]]), "actor.skip_zero_advantage_backward=false")
    assert on[2][SKIPPED] == 2.0 and on[2]["actor/zero_grad_steps_skipped"] == 1.0
    _same_update(on, off)


def test_a_micro_batch_mixing_flat_and_varied_groups_runs_its_backward():
    on = _update(_mixed_batch(MIXED), "actor.micro_batch_size=4")
    assert on[2][SKIPPED] == 1.0  # rows 0-3 and 4-7 hold a varied group each; rows 8-9 are the flat last group
    _same_update(on, _update(_mixed_batch(MIXED), "actor.micro_batch_size=4", "actor.skip_zero_advantage_backward=false"))


@pytest.mark.parametrize("extra, ref", [
    (["actor.entropy_coeff=0.01"], False),
    (["actor.use_kl_loss=true"], True),
    (["actor.skip_zero_advantage_backward=false"], False),
])
def test_the_skip_is_off_when_the_loss_has_another_term(extra, ref):
    m = _update(_mixed_batch(MIXED), *extra, ref=ref)[2]
    assert m[SKIPPED] == 0.0 and m["actor/optimizer_steps"] == 1.0


def test_recorded_zero_gradients_are_those_a_backward_writes():
    """Zeros go to the weights the graph reaches and have no gradient yet; others stay as they are."""
    reached, kept, unreached = (torch.nn.Parameter(torch.randn(3)) for _ in range(3))
    kept.grad = torch.ones(3)
    loss = (torch.zeros(3) * (reached * 2 + kept)).sum()
    assert record_zero_gradients(loss, [reached, kept, unreached])
    assert torch.equal(reached.grad, torch.zeros(3)) and torch.equal(kept.grad, torch.ones(3))
    assert unreached.grad is None
    reference = [torch.nn.Parameter(p.detach().clone()) for p in (reached, kept, unreached)]
    reference[1].grad = torch.ones(3)
    (torch.zeros(3) * (reference[0] * 2 + reference[1])).sum().backward()
    assert torch.equal(reference[0].grad, reached.grad) and torch.equal(reference[1].grad, kept.grad)
    assert reference[2].grad is None


def test_a_reentrant_checkpoint_is_not_skipped_past():
    weight = torch.nn.Parameter(torch.randn(3))
    x = torch.randn(3, requires_grad=True)
    hidden = torch.utils.checkpoint.checkpoint(lambda t: t * weight, x, use_reentrant=True)
    assert not record_zero_gradients((0 * hidden).sum(), [weight])
    assert weight.grad is None
