"""Shared-prefix training forward == plain full-row forward (values and gradients)."""

from __future__ import annotations

import pytest
import torch
from _tiny_llama import tiny_llama

from agentrl.harmony.trajectory import Trajectory
from agentrl.train.batch import collate
from agentrl.train.prefix_sharing import shared_prefix_logprobs, supports_prefix_sharing
from agentrl.train.update import forward_logprobs


def _tiny_llama():
    return tiny_llama(0, vocab=300, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, positions=256)


def _batch():
    prefix = list(range(40, 80))
    trajs = [
        Trajectory(prompt_ids=prefix + [5, 6], response_ids=[7, 8, 9, 10], response_mask=[1, 1, 0, 1],
                   rollout_logprobs=[0.0] * 4),
        Trajectory(prompt_ids=prefix + [11, 12, 13, 14], response_ids=[15], response_mask=[1],
                   rollout_logprobs=[0.0]),
        Trajectory(prompt_ids=prefix + [16], response_ids=[17, 18], response_mask=[1, 1], rollout_logprobs=[0.0] * 2),
    ]
    return collate(trajs, [0, 0, 1])


def test_values_and_gradients_match_plain_forward():
    model = _tiny_llama()
    batch = _batch()
    assert supports_prefix_sharing(model)
    shared_lp, shared_ent = shared_prefix_logprobs(model, batch, chunk_size=7, temperature=0.9, compute_entropy=True)
    real = batch.attention_mask[:, batch.prompt_width:].bool()
    loss = (shared_lp * batch.response_mask).sum() + (shared_ent * real).sum()
    grads_shared = torch.autograd.grad(loss, list(model.parameters()))
    plain_lp, plain_ent = forward_logprobs(model, batch, chunk_size=7, temperature=0.9, compute_entropy=True)
    assert torch.allclose(shared_lp[real], plain_lp[real], atol=1e-5)
    assert (shared_lp[~real] == 0).all()
    assert torch.allclose(shared_ent[real], plain_ent[real], atol=1e-5)
    loss = (plain_lp * batch.response_mask).sum() + (plain_ent * real).sum()
    for g_shared, g_plain in zip(grads_shared, torch.autograd.grad(loss, list(model.parameters())), strict=True):
        assert torch.allclose(g_shared, g_plain, atol=1e-4, rtol=1e-3)


def test_falls_back_when_not_applicable():
    model = _tiny_llama()
    batch = _batch()
    assert shared_prefix_logprobs(model, batch.select([0]), chunk_size=8, temperature=1.0, compute_entropy=False) is None
    assert shared_prefix_logprobs(model, batch, chunk_size=8, temperature=1.0, compute_entropy=False,
                                  min_prefix=100) is None
    from agentrl.models.tiny import tiny_gpt_oss

    assert not supports_prefix_sharing(tiny_gpt_oss(vocab=300))  # sliding-window attention


@pytest.mark.parametrize("share", [True, False])
def test_forward_logprobs_switch(share):
    lp, _ = forward_logprobs(_tiny_llama(), _batch(), chunk_size=8, temperature=1.0, compute_entropy=False,
                             share_prefix=share)
    assert lp.shape == (3, 4)
