"""TransformersEngine: log-probs equal the model's own, padding-invariant, stops, concurrent batching."""

from __future__ import annotations

import asyncio

import pytest
import torch
from _tiny_llama import tiny_llama

from agentrl.engines.base import SamplingParams
from agentrl.engines.transformers_engine import TransformersEngine, _filter_logits
from agentrl.models.tiny import tiny_gpt_oss


@pytest.fixture(scope="module")
def model():
    return tiny_gpt_oss(num_layers=2, hidden=32, experts=4, top_k=2, vocab=300, seed=1)


def _teacher_forced(model, prompt, completion, temperature):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    if temperature > 0:
        logits = logits / temperature
    lp = torch.log_softmax(logits, -1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion)]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_match_teacher_forcing_with_left_padding(model, temperature):
    engine = TransformersEngine(model, pad_token_id=0, seed=3)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23]]
    out = engine.generate_sync(prompts, SamplingParams(max_new_tokens=6, temperature=temperature))
    assert len(out) == 3
    for prompt, comp in zip(prompts, out, strict=True):
        assert len(comp.token_ids) == len(comp.logprobs) == 6
        assert comp.finish_reason == "length"
        ref = _teacher_forced(model, prompt, comp.token_ids, temperature)
        assert comp.logprobs == pytest.approx(ref, abs=1e-4)


def test_greedy_is_batch_invariant_and_stops(model):
    engine = TransformersEngine(model, pad_token_id=0)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    alone = engine.generate_sync([[12, 13]], greedy)[0]
    batched = engine.generate_sync([[5, 6, 7, 8, 9, 10, 11], [12, 13]], greedy)[1]
    assert alone.token_ids == batched.token_ids
    stop_at = alone.token_ids[2]
    stopped = engine.generate_sync([[12, 13]], SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=[stop_at]))[0]
    first = alone.token_ids.index(stop_at)
    assert stopped.token_ids == alone.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"


def test_seeded_sampling_is_reproducible(model):
    engine = TransformersEngine(model, pad_token_id=0)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    engine.reseed(7)
    a = engine.generate_sync([[1, 2, 3]] * 4, params)
    engine.reseed(7)
    b = engine.generate_sync([[1, 2, 3]] * 4, params)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert len({tuple(c.token_ids) for c in a}) > 1  # rows sample independently


def test_concurrent_callers_are_micro_batched(model):
    engine = TransformersEngine(model, pad_token_id=0, max_batch_size=3)
    params = SamplingParams(max_new_tokens=4, temperature=0.0)

    async def main():
        return await asyncio.gather(*[engine.generate([[i + 1, i + 2]], params) for i in range(5)])

    results = asyncio.run(main())
    assert [len(r) for r in results] == [1] * 5
    assert engine.stats["batches"] == 2  # 5 requests, max 3 per batch
    for i, (comp,) in enumerate(results):
        assert comp.token_ids == engine.generate_sync([[i + 1, i + 2]], params)[0].token_ids


def test_every_batch_samples_on_the_engines_one_thread(model):
    """Batches of several collections and event loops all run on one thread of the engine's own (glibc keeps
    a thread's freed KV caches in that thread's arena: spread over many threads, they added up)."""
    import threading

    engine = TransformersEngine(model, pad_token_id=0, max_batch_size=2)
    params = SamplingParams(max_new_tokens=2, temperature=0.0)
    threads: list[int] = []
    hook = model.register_forward_hook(lambda *_: threads.append(threading.get_ident()))

    async def main():
        for _ in range(3):  # 3 collections of 5 concurrent callers: 3 batches each
            await asyncio.gather(*[engine.generate([[i + 1, i + 2]], params) for i in range(5)])

    try:
        asyncio.run(main())
        asyncio.run(main())  # a second event loop (a new default executor) keeps the same thread
    finally:
        hook.remove()
    assert engine.stats["batches"] == 18
    assert len(set(threads)) == 1 and threads[0] != threading.get_ident()


def test_filter_logits_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(_filter_logits(logits, 2, 1.0)[0, 2:]).all()
    kept = ~torch.isinf(_filter_logits(logits, 0, 0.7)[0])
    assert kept.tolist() == [True, True, False, False]


def test_bad_requests_raise(model):
    engine = TransformersEngine(model)
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate_sync([[]], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="max_batch_size"):
        TransformersEngine(model, max_batch_size=0)


def _tiny_llama():
    return tiny_llama(0, vocab=300, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, positions=256).eval()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_shared_prefix_matches_teacher_forcing(temperature):
    model = _tiny_llama()
    prefix = list(range(30, 60))
    prompts = [prefix + [7, 8, 9], prefix + [11], prefix + [12, 13, 14, 15, 16]]
    shared = TransformersEngine(model, seed=5)
    assert shared._shared_prefix_len(prompts) == 30
    out = shared.generate_sync(prompts, SamplingParams(max_new_tokens=5, temperature=temperature))
    for prompt, comp in zip(prompts, out, strict=True):
        assert comp.logprobs == pytest.approx(_teacher_forced(model, prompt, comp.token_ids, temperature), abs=1e-4)
    plain = TransformersEngine(model, seed=5, share_prefix=False)
    greedy = SamplingParams(max_new_tokens=5, temperature=0.0)
    assert [c.token_ids for c in plain.generate_sync(prompts, greedy)] == [
        c.token_ids for c in shared.generate_sync(prompts, greedy)
    ]


def test_prefix_sharing_off_for_sliding_window(model):
    assert TransformersEngine(model).share_prefix is False


def test_routing_recording_covers_fed_tokens(model):
    engine = TransformersEngine(model, record_routing=True, seed=2)
    prompts = [[5, 6, 7, 8], [9, 10]]
    stop_free = SamplingParams(max_new_tokens=4, temperature=1.0)
    out = engine.generate_sync(prompts, stop_free)
    for prompt, comp in zip(prompts, out, strict=True):
        layers, n, k = comp.routing.shape
        assert (layers, k) == (2, 2)
        assert n == len(prompt) + len(comp.token_ids) - 1  # the last sampled token is never fed
        assert comp.routing.min() >= 0 and comp.routing.max() < 4


def test_generation_records_no_autograd_graph_on_any_thread(model):
    """A model whose parameters train (requires_grad) decodes without autograd, also through the async path whose
    sampling runs on a worker thread (grad mode is per thread). With a graph, the KV cache keeps every step's
    activations alive: GPT-OSS-20B with LoRA ran out of 140 GB of GPU memory in its first rollout."""
    grad_modes: list[bool] = []
    hook = model.register_forward_hook(lambda *_: grad_modes.append(torch.is_grad_enabled()))
    assert any(p.requires_grad for p in model.parameters())
    engine = TransformersEngine(model, pad_token_id=0)
    params = SamplingParams(max_new_tokens=3, temperature=1.0, seed=0)
    try:
        engine.generate_sync([[1, 2, 3]], params)
        asyncio.run(engine.generate([[4, 5, 6]], params))
    finally:
        hook.remove()
    assert grad_modes and not any(grad_modes)
