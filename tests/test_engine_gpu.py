"""The decode engine on a GPU: CUDA-graph decode steps (GPT-OSS through the sink-attention kernel inside the
graph), log-probs against a teacher-forced full forward, greedy tokens against the transformers engine
(float32: bf16 ties make token identity ill-posed), continuous batching under random arrivals, routing
capture, weight updates, and freeing the cache. Skipped without CUDA."""

from __future__ import annotations

import asyncio
import random

import pytest
from _fixtures import greedy_tokens

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from agentrl.engines.base import SamplingParams  # noqa: E402
from agentrl.engines.decode.decode_engine import DecodeEngine  # noqa: E402
from agentrl.models.routing import record_routing  # noqa: E402
from agentrl.models.tiny import tiny_gpt_oss  # noqa: E402

pytestmark = pytest.mark.gpu
VOCAB = 512


def _llama(dtype):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    return transformers.LlamaForCausalLM(cfg).to("cuda", dtype).eval()


def _gpt_oss(dtype):
    return tiny_gpt_oss(num_layers=4, hidden=256, experts=8, top_k=2, vocab=VOCAB, seed=1, sliding_window=16,
                        dtype=dtype, device="cuda")


MODELS = {"llama": _llama, "gpt_oss": _gpt_oss}


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(40)]
    return [system + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 60))] for _ in range(n)]


def _teacher_forced(model, prompt, completion, temperature):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion], device="cuda")).logits[0].float()
    lp = torch.log_softmax(logits / temperature, -1)
    return torch.tensor([lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion)])


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_equal_a_teacher_forced_forward(name, dtype):
    """GPT-OSS's reference forward replays the rollout's routing: an expert flipped by rounding changes a
    log-prob by far more than rounding does (that is what routing replay is for)."""
    from agentrl.models.routing import replay_routing

    model = MODELS[name](dtype)
    moe = name == "gpt_oss"
    engine = DecodeEngine(model, seed=1, record_routing=moe)
    assert engine.runner.cuda_graphs
    prompts = _prompts(12)
    out = engine.generate_sync(prompts, SamplingParams(max_new_tokens=40, temperature=1.0))
    gaps = []
    for p, c in zip(prompts, out, strict=True):
        if moe:
            with replay_routing(model, c.routing[:, None]):
                ref = _teacher_forced(model, p, c.token_ids, 1.0)
        else:
            ref = _teacher_forced(model, p, c.token_ids, 1.0)
        gaps.append((torch.tensor(c.logprobs) - ref).abs())
    gaps = torch.cat(gaps)
    # exact: IEEE float32 attention; the sink kernel's float32 dots are TF32; bf16: bf16
    layout_exact = engine.runner.attention.layout == "head"
    mean_tol, max_tol = ((1e-5, 1e-4) if dtype == torch.float32 and layout_exact else
                         (2e-3, 0.2) if dtype == torch.float32 else (2e-2, 1.0))
    assert float(gaps.mean()) < mean_tol and float(gaps.max()) < max_tol, (float(gaps.mean()), float(gaps.max()))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_tokens_equal_the_transformers_engine_in_float32(name):
    new, old = greedy_tokens(MODELS[name](torch.float32), _prompts(6, seed=2))
    assert new == old


def test_graphs_replay_what_eager_steps_compute():
    model = _llama(torch.float32)
    params = SamplingParams(max_new_tokens=30, temperature=1.0, top_k=50, top_p=0.9)
    prompts = _prompts(5, seed=3)
    graphs = DecodeEngine(model, seed=4).generate_sync(prompts, params)
    eager = DecodeEngine(model, seed=4, cuda_graphs=False).generate_sync(prompts, params)
    assert [c.token_ids for c in graphs] == [c.token_ids for c in eager]
    for a, b in zip(graphs, eager, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_gpt_oss_decodes_through_the_sink_kernel_inside_the_graph(monkeypatch):
    import agentrl.kernels as kernels
    from agentrl.kernels import _dispatch

    calls, choices = [], []
    real_choose, real_attention = _dispatch.choose, kernels.sink_attention

    def choose(*args, **kwargs):
        choices.append((kwargs["n_q"], real_choose(*args, **kwargs)))
        return choices[-1][1]

    def counted(q, *args, **kwargs):
        calls.append((tuple(q.shape), torch.cuda.is_current_stream_capturing()))
        return real_attention(q, *args, **kwargs)

    monkeypatch.setattr(_dispatch, "choose", choose)
    monkeypatch.setattr(kernels, "sink_attention", counted)
    model = _gpt_oss(torch.bfloat16)
    engine = DecodeEngine(model)
    out = engine.generate_sync(_prompts(8, seed=5), SamplingParams(max_new_tokens=20, temperature=1.0))
    assert all(len(c.token_ids) == 20 for c in out)
    assert engine.runner._graphs, "no decode graph was captured"
    assert any(capturing for _, capturing in calls), "sink_attention was not called inside graph capture"
    assert {choice for n_q, choice in choices if n_q == 1} == {"triton"}  # the decode path


def test_routing_is_captured_inside_graphs():
    model = _gpt_oss(torch.float32)
    engine = DecodeEngine(model, record_routing=True, seed=6)
    prompts = _prompts(4, seed=6)
    out = engine.generate_sync(prompts, SamplingParams(max_new_tokens=16, temperature=1.0))
    agree = total = 0
    for prompt, comp in zip(prompts, out, strict=True):
        fed = prompt + comp.token_ids[:-1]
        assert comp.routing.shape == (4, len(fed), 2)
        with torch.no_grad(), record_routing(model) as rec:
            model(input_ids=torch.tensor([fed], device="cuda"))
        agree += int((comp.routing.sort(-1).values == rec.routing()[:, 0].sort(-1).values).all(-1).sum())
        total += comp.routing.shape[0] * comp.routing.shape[1]
    assert agree / total > 0.99  # TF32 attention: near-tied routers may flip on a few tokens


def test_random_arrivals_never_mix_rows_or_drop_tokens():
    model = _llama(torch.float32)
    greedy = SamplingParams(max_new_tokens=20, temperature=0.0, stop_token_ids=[7])
    engine = DecodeEngine(model, max_batch_size=6)
    rng = random.Random(7)
    prompts = _prompts(20, seed=7)

    async def episode(k):
        prompt, out = prompts[k], []
        for _ in range(rng.randint(1, 3)):
            await asyncio.sleep(rng.random() * 0.05)
            (comp,) = await engine.generate([prompt], greedy)
            out.append((prompt, comp))
            prompt = prompt + comp.token_ids + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))]
        return out

    async def main():
        return await asyncio.gather(*(episode(k) for k in range(len(prompts))))

    results = [turn for episode in asyncio.run(main()) for turn in episode]
    alone = DecodeEngine(model, max_batch_size=1, share_prefix=False)
    for prompt, comp in results:
        assert comp.token_ids == alone.generate_sync([prompt], greedy)[0].token_ids


def test_weight_updates_are_seen_and_moved_weights_recaptured():
    model = _llama(torch.bfloat16)
    engine = DecodeEngine(model)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    prompts = _prompts(3, seed=8)
    before = engine.generate_sync(prompts, greedy)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # in place, as an optimizer step
    updated = engine.generate_sync(prompts, greedy)
    fresh = DecodeEngine(model).generate_sync(prompts, greedy)
    assert [c.token_ids for c in updated] == [c.token_ids for c in fresh] != [c.token_ids for c in before]
    for p in model.parameters():
        p.data = p.data.clone()  # new storage, as FSDP's unshard or verl's release/resume
    assert [c.token_ids for c in engine.generate_sync(prompts, greedy)] == [c.token_ids for c in fresh]


def test_release_frees_the_cache():
    model = _llama(torch.bfloat16)
    engine = DecodeEngine(model)
    engine.generate_sync(_prompts(32, seed=9), SamplingParams(max_new_tokens=16, temperature=1.0))
    cache_bytes = engine.runner.cache.kv.numel() * engine.runner.cache.kv.element_size()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    engine.release()
    torch.cuda.synchronize()
    freed = held - torch.cuda.memory_allocated()
    assert cache_bytes > 10 * 2**20 and freed >= cache_bytes, (cache_bytes, freed)


def test_auto_picks_the_decode_engine_on_cuda():
    from agentrl.engines.factory import choose_kind, make_engine

    assert isinstance(make_engine(_llama(torch.bfloat16)), DecodeEngine)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50, n_embd=32, n_layer=1, n_head=2))
    assert choose_kind(gpt2.to("cuda")) == "transformers"  # what the decode engine cannot run
