"""The in-place KV cache gives exactly what transformers' DynamicCache gives: prefill, decode, row pruning,
prefix repetition, and the engine's sampled tokens and log-probs."""

from __future__ import annotations

import pytest
from _tiny_llama import tiny_llama

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from agentrl.engines.base import SamplingParams  # noqa: E402
from agentrl.engines.kv_cache import GrowingCache, growing_cache_for  # noqa: E402


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(0, vocab=97, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, positions=256).eval()


@torch.no_grad()
def _decode(model, cache, ids, steps, select=None):
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    cache, logits = out.past_key_values, [out.logits[:, -1]]
    nxt = logits[-1].argmax(-1, keepdim=True)
    for k in range(steps):
        if select is not None and k == 1:
            cache.batch_select_indices(select)
            nxt = nxt[select]
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits.append(out.logits[:, -1])
        nxt = logits[-1].argmax(-1, keepdim=True)
    return logits


def test_growing_cache_matches_dynamic_cache(llama):
    ids = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(1))
    select = torch.tensor([0, 2])
    for reserve in (1, 4, 64):  # 1 and 4 force reallocations while decoding
        plain = _decode(llama, None, ids, 6, select)
        grown = _decode(llama, GrowingCache(2, reserve=reserve), ids, 6, select)
        for a, b in zip(plain, grown, strict=True):
            assert torch.equal(a, b)


def test_growing_cache_prefix_repeat(llama):
    prefix = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        caches = []
        for cache in (None, GrowingCache(2, reserve=8)):
            c = llama(input_ids=prefix, past_key_values=cache, use_cache=True).past_key_values
            c.batch_repeat_interleave(3)
            suffix = torch.randint(0, 97, (3, 4), generator=torch.Generator().manual_seed(3))
            caches.append(llama(input_ids=suffix, past_key_values=c, use_cache=True).logits)
    assert torch.equal(caches[0], caches[1])


def test_engine_uses_it_and_samples_the_same(llama, monkeypatch):
    import agentrl.engines.transformers_engine as te

    assert isinstance(growing_cache_for(llama, 4), GrowingCache)
    prompts = [[5] * 20 + [i, i + 1] for i in range(4)]  # a shared prefix, then distinct suffixes
    sampling = SamplingParams(max_new_tokens=7, temperature=0.8, stop_token_ids=[3])
    runs = []
    for factory in (growing_cache_for, lambda model, reserve: None):
        monkeypatch.setattr(te, "growing_cache_for", factory)
        engine = te.TransformersEngine(llama, seed=5)
        runs.append(engine.generate_sync(prompts, sampling))
    assert [c.token_ids for c in runs[0]] == [c.token_ids for c in runs[1]]
    assert [c.logprobs for c in runs[0]] == [c.logprobs for c in runs[1]]
