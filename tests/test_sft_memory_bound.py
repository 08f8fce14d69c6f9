"""SFT memory does not grow with the trajectories' lengths: a micro-batch is run in forwards of at
most ``max_forward_tokens`` tokens, a longer trajectory alone with activation checkpointing, and the loss and
gradient are those of one forward over the whole micro-batch."""

from __future__ import annotations

import pytest
from _tiny_llama import tiny_llama

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from agentrl.harmony.trajectory import Trajectory  # noqa: E402
from agentrl.train.activation_checkpointing import activation_checkpointing  # noqa: E402
from agentrl.train.sft import SFTStage, activation_tokens, forward_groups  # noqa: E402

PREFIX = list(range(1, 41))  # a 40-token system prompt every trajectory shares


def _traj(question: int, response_len: int) -> Trajectory:
    response = [(7 * question + k) % 60 + 2 for k in range(response_len)]
    mask = [1 if (k // 5) % 2 == 0 else 0 for k in range(response_len)]  # model and env tokens alternate
    return Trajectory(prompt_ids=[*PREFIX, 50 + question % 10, 51], response_ids=response, response_mask=mask,
                      rollout_logprobs=[0.0] * response_len)


def _data() -> list[Trajectory]:
    return [_traj(q, n) for q, n in enumerate([12, 300, 30, 8, 160, 45, 20, 90])]


def _model(seed: int = 0):
    return tiny_llama(seed, vocab=64, hidden=32, intermediate=48, layers=2, heads=4, kv_heads=2, positions=512,
                      tie_word_embeddings=True).train()


def test_activation_tokens_counts_the_shared_prefix_once():
    a, b = _traj(0, 10), _traj(1, 20)  # prompts of 42 tokens sharing 40
    assert activation_tokens([a, b], share_prefix=False) == 2 * (42 + 20)
    assert activation_tokens([a, b], share_prefix=True) == 40 + 2 * 22
    short = Trajectory(prompt_ids=[1, 2, 3], response_ids=[4], response_mask=[1], rollout_logprobs=[0.0])
    assert activation_tokens([short, short], share_prefix=True) == 2 * 4  # a prefix under 32 tokens is not shared


def test_forward_groups_keep_every_trajectory_within_the_budget_or_alone():
    data = _data()
    groups = forward_groups(data, 200, share_prefix=True)
    assert sorted(id(t) for g in groups for t in g) == sorted(id(t) for t in data)
    for g in groups:
        assert len(g) == 1 or activation_tokens(g, share_prefix=True) <= 200
    assert [len(g) for g in groups if activation_tokens(g, share_prefix=True) > 200] == [1, 1]  # 342 and 202 tokens
    assert forward_groups(data, 10**6, share_prefix=True) == [sorted(data, key=lambda t: -len(t.response_ids))]


def _step(max_forward_tokens: int, monkeypatch=None):
    """One SFT step on the data; returns (metrics, gradients, tokens seen by each backbone forward and whether
    it ran with activation checkpointing)."""
    model = _model()
    seen: list[tuple[int, bool]] = []
    model.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((kwargs["input_ids"].numel(), model.is_gradient_checkpointing)),
        with_kwargs=True,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # no update: compare the gradients
    stage = SFTStage(model, opt, _data(), batch_size=8, micro_batch_size=8, pad_token_id=0,
                     max_forward_tokens=max_forward_tokens)
    metrics = stage.step(0)
    return metrics, {k: p.grad.clone() for k, p in model.named_parameters()}, seen


def test_one_micro_batch_in_bounded_forwards_gives_the_same_loss_and_gradient():
    whole, grads_whole, seen_whole = _step(10**6)
    split, grads_split, seen_split = _step(150)
    assert whole["sft/forwards"] == 1 and len(seen_whole) == 2  # the shared prefix, then the 8 suffixes
    assert split["sft/forwards"] > 1 and split["sft/checkpointed_forwards"] == 2  # the 300- and 160-token ones
    for tokens, checkpointed in seen_split:
        assert checkpointed or tokens <= 150
    assert split["sft/loss"] == pytest.approx(whole["sft/loss"], rel=1e-5)
    assert split["sft/model_tokens"] == whole["sft/model_tokens"]
    for name, g in grads_whole.items():
        torch.testing.assert_close(grads_split[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_activation_checkpointing_is_restored_and_keeps_fewer_activations():
    model = _model()
    ids = torch.randint(2, 64, (1, 400))

    def saved_bytes() -> int:
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.model(input_ids=ids, use_cache=False).last_hidden_state.sum().backward()
        return total

    plain = saved_bytes()
    with activation_checkpointing(model) as on:
        assert on and model.is_gradient_checkpointing
        checkpointed = saved_bytes()
    assert not model.is_gradient_checkpointing
    assert checkpointed < plain / 2
    with activation_checkpointing(model, enabled=False) as on:
        assert not on and not model.is_gradient_checkpointing


def test_sft_never_builds_tokens_by_vocab_logits():
    """The loss goes through the chunked log-prob path (lm_head's weight in chunks): the LM head module itself,
    which would return [tokens, vocab] logits, is never called."""
    model = _model()

    def full_logits(module, args, output):
        raise AssertionError(f"[tokens x vocab] logits built: {tuple(output.shape)}")

    model.lm_head.register_forward_hook(full_logits)
    stage = SFTStage(model, torch.optim.SGD(model.parameters(), lr=0.1), _data(), batch_size=8, micro_batch_size=8,
                     pad_token_id=0, max_forward_tokens=150)
    assert stage.step(0)["sft/loss"] > 0
