"""The decode engine with real (tiny, random) models on the CPU: the same tokens as the transformers engine,
exact log-probs, routing, turn reuse, continuous batching under random arrivals, the deterministic mode,
streaming, release and abort. CUDA graphs and the GPU kernels are in ``tests/test_engine_gpu.py``."""

from __future__ import annotations

import asyncio
import random

import pytest
from _tiny_llama import tiny_llama

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _profiles import examples  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from agentrl.engines.base import EngineAborted, SamplingParams  # noqa: E402
from agentrl.engines.decode.decode_engine import DecodeEngine  # noqa: E402
from agentrl.engines.transformers_engine import TransformersEngine  # noqa: E402
from agentrl.models.routing import record_routing  # noqa: E402
from agentrl.models.tiny import tiny_gpt_oss  # noqa: E402

VOCAB = 300


def _llama(seed: int = 0):
    return tiny_llama(seed, vocab=VOCAB, hidden=64, intermediate=96, layers=2, heads=4, kv_heads=2, positions=512).eval()


def _qwen3():
    torch.manual_seed(2)
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=512)
    return transformers.Qwen3ForCausalLM(cfg).eval()


def _gpt_oss():
    return tiny_gpt_oss(num_layers=2, hidden=64, experts=4, top_k=2, vocab=VOCAB, seed=1, sliding_window=6)


MODELS = {"llama": _llama, "qwen3": _qwen3, "gpt_oss": _gpt_oss}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    return MODELS[request.param]()


@pytest.fixture(scope="module")
def llama():
    return _llama()


def _teacher_forced(model, prompt, completion, temperature):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    lp = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), -1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion)]


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [12, 13], [20, 21, 22, 23], list(range(40, 80))]


@pytest.mark.parametrize("share_prefix", [True, False])
def test_greedy_tokens_equal_the_transformers_engine(model, share_prefix):
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    old = TransformersEngine(model).generate_sync(PROMPTS, greedy)
    new = DecodeEngine(model, share_prefix=share_prefix, max_batch_size=3).generate_sync(PROMPTS, greedy)
    assert [c.token_ids for c in new] == [c.token_ids for c in old]
    for a, b in zip(old, new, strict=True):
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
        assert b.finish_reason == a.finish_reason == "length"


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.8)])
def test_logprobs_equal_a_teacher_forced_forward(model, temperature, top_k, top_p):
    engine = DecodeEngine(model, seed=3)
    params = SamplingParams(max_new_tokens=12, temperature=temperature, top_k=top_k, top_p=top_p)
    for prompt, comp in zip(PROMPTS, engine.generate_sync(PROMPTS, params), strict=True):
        assert len(comp.token_ids) == len(comp.logprobs) == 12
        assert comp.logprobs == pytest.approx(_teacher_forced(model, prompt, comp.token_ids, temperature), abs=1e-4)


def test_stop_tokens_end_a_completion_and_are_included(llama):
    engine = DecodeEngine(llama)
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    alone = engine.generate_sync([[12, 13]], greedy)[0]
    stop_at = alone.token_ids[3]
    stopped = engine.generate_sync([[12, 13]], SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=[stop_at]))[0]
    assert stopped.token_ids == alone.token_ids[: alone.token_ids.index(stop_at) + 1]
    assert stopped.finish_reason == "stop"


def test_routing_equals_a_recorded_full_forward():
    model = _gpt_oss()
    engine = DecodeEngine(model, record_routing=True, seed=4)
    params = SamplingParams(max_new_tokens=7, temperature=1.0)
    first = engine.generate_sync(PROMPTS[:3], params)
    # a second turn resumes the cached slot: its routing covers the earlier turn's tokens too
    second_prompt = PROMPTS[0] + first[0].token_ids + [3, 4, 5]
    second = engine.generate_sync([second_prompt], params)[0]
    for prompt, comp in [*zip(PROMPTS[:3], first, strict=True), (second_prompt, second)]:
        fed = prompt + comp.token_ids[:-1]
        assert comp.routing.shape == (2, len(fed), 2) and comp.routing.dtype == torch.int64
        with torch.no_grad(), record_routing(model) as rec:
            model(input_ids=torch.tensor([fed]))
        assert torch.equal(comp.routing, rec.routing()[:, 0])


def test_next_turn_reuses_the_cache_and_equals_a_fresh_prefill(model):
    engine, fresh = DecodeEngine(model), DecodeEngine(model, share_prefix=False)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    first = engine.generate_sync(PROMPTS, greedy)
    prompts = [p + c.token_ids + [7, 8] for p, c in zip(PROMPTS, first, strict=True)]
    prefilled_before = engine.stats["batches"]
    again = engine.generate_sync(prompts, greedy)
    assert engine.stats["batches"] > prefilled_before
    assert [c.token_ids for c in again] == [c.token_ids for c in fresh.generate_sync(prompts, greedy)]
    assert {id(engine.scheduler.slots[s]) for s in range(len(PROMPTS))}  # slots kept for the next turn


async def _episode(engine, seed, prompt, turns, delays, params, rng_seed):
    """A multi-turn episode through a client: each turn's prompt extends the last with its completion and an
    observation; sleeps stand for tool calls."""
    rng = random.Random(rng_seed)
    out = []
    async with engine.client(seed) as client:
        for turn in range(turns):
            await asyncio.sleep(delays[turn % len(delays)])
            (comp,) = await client.generate([prompt], params)
            out.append((list(prompt), comp))
            prompt = prompt + comp.token_ids + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
    return out


def _solo(model, engine_seed, seed, prompt, params):
    async def one():
        async with DecodeEngine(model, share_prefix=False, max_batch_size=1, seed=engine_seed).client(seed) as client:
            return (await client.generate([prompt], params))[0]

    return asyncio.run(one())


@settings(max_examples=examples(8))
@given(seed=st.integers(0, 10_000), max_rows=st.integers(1, 5), temperature=st.sampled_from([0.0, 1.0]))
def test_random_arrivals_never_mix_rows_or_drop_tokens(llama, seed, max_rows, temperature):
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(rng.choice([0, 20]))]
    params = SamplingParams(max_new_tokens=rng.randint(2, 9), temperature=temperature, stop_token_ids=[rng.randrange(VOCAB)])
    specs = [(system + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))], rng.randint(1, 3),
              [rng.random() * 0.02 for _ in range(3)]) for _ in range(rng.randint(2, 6))]
    engine = DecodeEngine(llama, max_batch_size=max_rows, seed=seed)

    async def main():
        return await asyncio.gather(*(_episode(engine, k, p, t, d, params, seed + k) for k, (p, t, d) in enumerate(specs)))

    for k, turns in enumerate(asyncio.run(main())):
        for prompt, comp in turns:
            alone = _solo(llama, seed, k, prompt, params) if temperature > 0 else None
            if alone is None:
                alone = DecodeEngine(llama, share_prefix=False).generate_sync([prompt], params)[0]
            assert comp.token_ids == alone.token_ids
            assert comp.logprobs == pytest.approx(alone.logprobs, abs=1e-5)


def test_sampling_does_not_depend_on_the_batch(llama):
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    engine = DecodeEngine(llama, seed=9)

    async def run(seeds):
        clients = [engine.client(s) for s in seeds]
        out = await asyncio.gather(*(c.generate([[1, 2, 3]], params) for c in clients))
        for c in clients:
            c.close()
        return {s: o[0].token_ids for s, o in zip(seeds, out, strict=True)}

    together = asyncio.run(run([1, 2, 3, 4]))
    assert together[3] == asyncio.run(run([3]))[3]
    assert len({tuple(t) for t in together.values()}) > 1  # different clients sample differently
    engine.reseed(10)
    assert asyncio.run(run([3]))[3] != together[3]


def test_identical_requests_in_flight_together_both_complete(llama):
    """Two clients of one seed send the same prompt at once: their jobs are equal field by field, and the
    scheduler tells them apart by identity (comparing them by value recursed through their owners)."""
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    engine = DecodeEngine(llama, seed=9)

    async def run():
        clients = [engine.client(5), engine.client(5)]
        out = await asyncio.gather(*(c.generate([[1, 2, 3]], params) for c in clients))
        for c in clients:
            c.close()
        return [o[0].token_ids for o in out]

    first, second = asyncio.run(run())
    assert first == second and len(first) == 10


def _traced(engine):
    """Record, per step, the request keys admitted and the slots decoding."""
    trace, step = [], engine.scheduler.step

    def traced_step():
        queued = {j.sampling.key for j in engine.scheduler.queue} | {j.sampling.key for j in engine.scheduler.incoming}
        advanced, finished = step()
        trace.append((sorted(queued), sorted(engine.scheduler.running), sorted(j.sampling.key for j in finished)))
        return advanced, finished

    engine.scheduler.step = traced_step
    return trace


def test_deterministic_mode_gives_the_same_batches_whatever_the_timing(llama):
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    results, traces = [], []
    for timing_seed in (0, 1):
        rng = random.Random(timing_seed)
        engine = DecodeEngine(llama, max_batch_size=3, deterministic=True, seed=5)
        trace = _traced(engine)

        async def main(engine=engine, rng=rng):
            return await asyncio.gather(*(
                _episode(engine, k, [k + 1, k + 2, k + 3], 3, [rng.random() * 0.03 for _ in range(3)], params, k)
                for k in range(5)))

        results.append([[c.token_ids for _, c in ep] for ep in asyncio.run(main())])
        traces.append(trace)
    assert results[0] == results[1]
    assert traces[0] == traces[1]


def test_streaming_calls_on_token_for_every_token_in_order(llama):
    engine = DecodeEngine(llama, chunk_steps=3)
    seen: dict[int, list[int]] = {0: [], 1: []}

    async def main():
        return await engine.generate([[1, 2], [3, 4, 5]], SamplingParams(max_new_tokens=7, temperature=0.0),
                                     on_token=lambda i, t: seen[i].append(t))

    out = asyncio.run(main())
    assert [seen[0], seen[1]] == [c.token_ids for c in out]


def test_tuning_takes_the_device_defaults_where_not_given(llama):
    from agentrl.engines.decode.tuning import DecodeTuning

    cpu = DecodeTuning(chunk_steps=1, cuda_graphs=False, attention="torch", fused=False, max_slots=8, min_length=0,
                       prefill_tokens=4096)
    assert DecodeTuning().resolve(llama, max_batch_size=8) == cpu
    engine = DecodeEngine(llama, max_batch_size=8, chunk_steps=3, max_slots=12)
    assert engine.tuning == DecodeTuning(**{**vars(cpu), "chunk_steps": 3, "max_slots": 12})
    assert engine.runner.chunk_steps == 3 and engine.scheduler.max_slots == 12


def test_release_frees_the_cache_and_the_engine_keeps_working(llama):
    engine = DecodeEngine(llama)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    a = engine.generate_sync([[1, 2, 3]], greedy)
    assert engine.runner.cache.allocated
    engine.release()
    assert not engine.runner.cache.allocated and engine.runner.state is None
    assert engine.generate_sync([[1, 2, 3]], greedy)[0].token_ids == a[0].token_ids


def test_abort_and_bad_requests(llama):
    engine = DecodeEngine(llama)
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate_sync([[]], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate_sync([[1]], SamplingParams(max_new_tokens=0))
    with pytest.raises(ValueError, match="max_batch_size"):
        DecodeEngine(llama, max_batch_size=0)
    engine.abort()
    with pytest.raises(EngineAborted):
        engine.generate_sync([[1, 2]], SamplingParams(max_new_tokens=3))

    async def main():
        return await engine.generate([[1, 2]], SamplingParams(max_new_tokens=3))

    with pytest.raises(EngineAborted):
        asyncio.run(main())


def test_unsupported_models_are_refused_with_the_reason():
    cfg = transformers.GPT2Config(vocab_size=50, n_embd=32, n_layer=1, n_head=2)
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        DecodeEngine(transformers.GPT2LMHeadModel(cfg))


def test_lora_models_decode_through_their_adapters():
    """A Llama with LoRA on every projection (attention and MLP); GPT-OSS with LoRA on its experts is in
    ``tests/test_engine_lora.py``."""
    pytest.importorskip("peft")
    from agentrl.engines.factory import choose_kind
    from agentrl.models.lora import LoraSpec, apply_lora

    llama = _llama(seed=3)
    apply_lora(llama, LoraSpec(rank=4), seed=1)
    with torch.no_grad():  # non-zero adapters, so that running without them would show
        for name, p in llama.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    assert choose_kind(llama, "decode") == "decode"
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    old = TransformersEngine(llama).generate_sync(PROMPTS, greedy)
    new = DecodeEngine(llama).generate_sync(PROMPTS, greedy)
    assert [c.token_ids for c in new] == [c.token_ids for c in old]
    for a, b in zip(old, new, strict=True):
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)


def test_deterministic_engine_serves_successive_event_loops(llama):
    engine = DecodeEngine(llama, deterministic=True)
    params = SamplingParams(max_new_tokens=3, temperature=1.0)

    async def one(seed, delay):
        async with engine.client(seed) as client:
            await asyncio.sleep(delay)  # the engine waits for this client before its first step
            return (await client.generate([[1, 2, 3]], params))[0].token_ids

    async def both():
        return await asyncio.gather(one(1, 0.0), one(2, 0.02))

    assert asyncio.run(both()) == asyncio.run(both())


def test_make_engine_picks_the_engine(llama):
    """``auto`` is the transformers engine on the CPU (the recorded CPU default path); ``decode`` asked for
    explicitly runs the decode engine on the CPU. ``auto`` on CUDA: ``tests/test_engine_gpu.py``."""
    from agentrl.engines.factory import make_engine

    assert isinstance(make_engine(llama), TransformersEngine)
    assert isinstance(make_engine(llama, kind="decode"), DecodeEngine)
    assert isinstance(make_engine(llama, kind="transformers"), TransformersEngine)
    with pytest.raises(ValueError, match="engine kind must be one of auto, decode, transformers"):
        make_engine(llama, kind="vllm")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50, n_embd=32, n_layer=1, n_head=2))
    assert isinstance(make_engine(gpt2), TransformersEngine)
    with pytest.raises(ValueError, match="engine=decode cannot run this model"):
        make_engine(gpt2, kind="decode")
    assert make_engine(llama, kind="decode", deterministic=True).deterministic
    with pytest.raises(ValueError, match="rollout.deterministic=true needs the decode engine"):
        make_engine(llama, deterministic=True)  # auto on the CPU: the transformers engine has no such mode
