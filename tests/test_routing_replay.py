"""Routing replay on a tiny GPT-OSS MoE (CPU, fp32): record during KV-cached sampling, replay in training."""

from __future__ import annotations

import pytest
import torch

from agentrl.models.routing import (
    align_to_mask,
    find_routers,
    record_routing,
    replay_routing,
    split_by_mask,
)
from agentrl.models.tiny import tiny_gpt_oss

V = 1024


@pytest.fixture(scope="module")
def rollout():
    model = tiny_gpt_oss(num_layers=2, hidden=64, experts=4, top_k=2, vocab=V, seed=11)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, V, (3, 6), generator=g)
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0  # left padding, as batched generation uses
    prompt[1, :2] = 0
    torch.manual_seed(0)
    with record_routing(model) as rec:
        out = model.generate(
            input_ids=prompt,
            attention_mask=mask,
            do_sample=True,
            top_k=0,
            top_p=1.0,
            max_new_tokens=8,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    seq = out.sequences
    full_mask = torch.cat([mask, torch.ones(3, seq.shape[1] - prompt.shape[1], dtype=mask.dtype)], dim=1)
    gen = seq[:, prompt.shape[1] :]
    logits = torch.stack(out.logits, dim=1).float()
    rollout_lp = torch.log_softmax(logits, -1).gather(-1, gen[..., None]).squeeze(-1)
    return model, seq, full_mask, rec.routing(), rollout_lp, prompt.shape[1]


def _train_logprobs(model, seq, mask, p):
    logits = model(input_ids=seq, attention_mask=mask).logits.float()
    return torch.log_softmax(logits[:, p - 1 : -1], -1).gather(-1, seq[:, p:, None]).squeeze(-1)


def _experts_seen(model):
    """Capture the router_indices each experts block receives (pre-hook on GptOssExperts)."""
    seen, handles = [], []
    for mlp, _ in find_routers(model):
        handles.append(mlp.experts.register_forward_pre_hook(lambda m, a: seen.append(a[1].clone())))
    return seen, handles


def test_record_shape_and_context_restores(rollout):
    model, seq, _, routing, _, _ = rollout
    assert routing.shape == (2, 3, seq.shape[1] - 1, 2) and routing.dtype == torch.long
    assert 0 <= routing.min() and routing.max() < 4
    for mlp, router in find_routers(model):
        assert "forward" not in router.__dict__
        assert not mlp._forward_pre_hooks


def test_replayed_indices_equal_recorded_and_logprobs_match(rollout):
    model, seq, mask, routing, rollout_lp, p = rollout
    seen, handles = _experts_seen(model)
    try:
        with replay_routing(model, routing) as rep, torch.no_grad():
            lp = _train_logprobs(model, seq, mask, p)
    finally:
        for h in handles:
            h.remove()
    assert rep.replayed_fraction == 1.0
    s_rec = routing.shape[2]
    for layer, idx in enumerate(seen):
        forced = idx.view(3, seq.shape[1], -1)[:, :s_rec]
        assert torch.equal(forced.sort(-1).values, routing[layer].sort(-1).values)
    torch.testing.assert_close(lp, rollout_lp, rtol=0, atol=1e-4)


def test_replay_is_effective_and_keeps_router_gradients(rollout):
    model, seq, mask, routing, rollout_lp, p = rollout
    other = (routing + 1) % 4  # a different, valid expert choice for every token
    with replay_routing(model, other), torch.no_grad():
        lp_other = _train_logprobs(model, seq, mask, p)
    assert (lp_other - rollout_lp).abs().max() > 1e-2  # forcing experts really changes the forward

    model.zero_grad()
    with replay_routing(model, routing):
        lp = _train_logprobs(model, seq, mask, p)
    lp.sum().backward()
    for _, router in find_routers(model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    model.zero_grad()


def test_realign_left_to_right_padding(rollout):
    model, seq, mask, routing, _, p = rollout
    samples = split_by_mask(routing, mask)
    assert [s.shape[1] for s in samples] == [int(mask[i, :-1].sum()) for i in range(3)]
    # right-pad row 1 instead of left-pad: move its tokens to the front
    n = int(mask[1].sum())
    seq_r, mask_r = seq.clone(), mask.clone()
    seq_r[1, :n], seq_r[1, n:] = seq[1, mask[1].bool()], 0
    mask_r[1, :n], mask_r[1, n:] = 1, 0
    aligned = align_to_mask(samples, mask_r)
    assert torch.equal(split_by_mask(aligned, mask_r)[1][:, : samples[1].shape[1]], samples[1])
    with torch.no_grad():
        with replay_routing(model, routing):
            left = model(input_ids=seq, attention_mask=mask).logits[1, mask[1].bool()]
        with replay_routing(model, aligned):
            right = model(input_ids=seq_r, attention_mask=mask_r).logits[1, :n]
    torch.testing.assert_close(left, right, rtol=0, atol=1e-4)


def test_layout_mismatch_and_bad_routing_raise(rollout):
    model, seq, mask, routing, _, _ = rollout
    with pytest.raises(ValueError, match="layout mismatch"), replay_routing(model, routing):
        model(input_ids=seq[:2], attention_mask=mask[:2])
    with pytest.raises(ValueError, match="top_k"):
        replay_routing(model, routing[..., :1])
    with pytest.raises(ValueError, match="experts"):
        replay_routing(model, routing + 4)
    for _, router in find_routers(model):
        assert "forward" not in router.__dict__


def test_nesting_refused_and_foreign_instance_forward_restored(rollout):
    model, seq, mask, routing, _, _ = rollout
    _, router = find_routers(model)[0]
    calls = []
    original = router.forward

    def foreign(hidden_states):  # stands in for accelerate's instance-level hook
        calls.append(1)
        return original(hidden_states)

    router.forward = foreign
    try:
        with record_routing(model), torch.no_grad():
            with pytest.raises(RuntimeError, match="cannot be nested"), record_routing(model):
                pass
            model(input_ids=seq[:1, :4])
        assert calls  # the foreign wrapper still ran inside our patch
        assert router.__dict__["forward"] is foreign
    finally:
        router.__dict__.pop("forward", None)
