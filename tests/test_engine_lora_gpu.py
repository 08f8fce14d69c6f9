"""The decode engine with the trainer's LoRA adapter on a GPU: CUDA-graph decode steps through the unmerged
attention and expert deltas. Log-probs against a teacher-forced PEFT forward (GPT-OSS with and without routing
replay), an adapter update between two ``generate`` calls seen without recapture, greedy tokens against the
transformers engine in float32, and ``auto`` picking the decode engine. The CPU versions are in
``tests/test_engine_lora.py``. Skipped without CUDA."""

from __future__ import annotations

import random

import pytest
from _fixtures import greedy_tokens, randomize_adapters

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from agentrl.engines.base import SamplingParams  # noqa: E402
from agentrl.engines.decode.decode_engine import DecodeEngine  # noqa: E402
from agentrl.models.lora import LoraSpec, adapter_state_dict, apply_lora  # noqa: E402
from agentrl.models.routing import replay_routing  # noqa: E402
from agentrl.models.tiny import tiny_gpt_oss  # noqa: E402

pytestmark = pytest.mark.gpu
VOCAB = 512


def _randomize(model, seed: int) -> None:
    randomize_adapters(model, seed, scale=0.05)


def _llama(dtype, seed: int = 5):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    model = transformers.LlamaForCausalLM(cfg).to("cuda", dtype).eval()
    apply_lora(model, LoraSpec(rank=8), seed=1)
    _randomize(model, seed)
    return model


def _gpt_oss(dtype, seed: int = 5):
    model = tiny_gpt_oss(num_layers=4, hidden=256, experts=8, top_k=2, vocab=VOCAB, seed=1, sliding_window=16,
                         dtype=dtype, device="cuda")
    apply_lora(model, LoraSpec(rank=8), seed=1)  # attention and both expert tensors
    _randomize(model, seed)
    return model


MODELS = {"llama": _llama, "gpt_oss": _gpt_oss}


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(40)]
    return [system + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 60))] for _ in range(n)]


def _teacher_forced(model, prompt, completion):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion], device="cuda")).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return torch.tensor([lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion)])


def _gaps(model, prompts, out, replay: bool) -> torch.Tensor:
    gaps = []
    for p, c in zip(prompts, out, strict=True):
        if replay:
            with replay_routing(model, c.routing[:, None]):
                ref = _teacher_forced(model, p, c.token_ids)
        else:
            ref = _teacher_forced(model, p, c.token_ids)
        gaps.append((torch.tensor(c.logprobs) - ref).abs())
    return torch.cat(gaps)


# (mean, max) bounds on |engine - PEFT forward| per token. float32 through the sink kernel: TF32 dots; bf16:
# bf16 rounding, and PEFT rounds W + s B A to bf16 where the engine adds the bf16 delta to the base output.
TOLERANCES = {torch.float32: (2e-3, 0.2), torch.bfloat16: (2e-2, 1.0)}
F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("name,replay,dtype,attention", [
    ("llama", False, F32, None), ("llama", False, BF16, None),
    ("gpt_oss", True, F32, None), ("gpt_oss", True, BF16, None),
    ("gpt_oss", False, F32, "torch"),
])
def test_logprobs_equal_a_teacher_forced_peft_forward(name, replay, dtype, attention):
    """GPT-OSS with routing replay in the reference (an expert flipped by rounding moves a log-prob by far more
    than rounding does), and without it in IEEE float32 (torch attention, no TF32), where flips are rare: there
    the bound is on the mean only."""
    model = MODELS[name](dtype)
    engine = DecodeEngine(model, seed=1, record_routing=name == "gpt_oss", attention=attention)
    assert engine.runner.cuda_graphs
    prompts = _prompts(12)
    out = engine.generate_sync(prompts, SamplingParams(max_new_tokens=40, temperature=1.0))
    gaps = _gaps(model, prompts, out, replay)
    mean_tol, max_tol = TOLERANCES[dtype]
    print(f"lora_gpu_gap {name} replay={replay} {dtype} attention={engine.runner.attention.__class__.__name__}: "
          f"mean={float(gaps.mean()):.2e} max={float(gaps.max()):.2e}")
    assert float(gaps.mean()) < mean_tol, float(gaps.mean())
    if replay or name != "gpt_oss":
        assert float(gaps.max()) < max_tol, float(gaps.max())


def test_an_adapter_update_is_seen_without_recapture():
    model = _gpt_oss(torch.bfloat16)
    engine = DecodeEngine(model, seed=2, record_routing=True)
    params = SamplingParams(max_new_tokens=24, temperature=1.0)
    prompts = _prompts(6, seed=4)
    first = engine.generate_sync(prompts, params)
    graphs = dict(engine.runner._graphs)
    assert graphs
    engine.update_lora(adapter_state_dict(_gpt_oss(torch.bfloat16, seed=9)))
    second = engine.generate_sync(prompts, params)
    assert all(engine.runner._graphs.get(k) is g for k, g in graphs.items())  # the same captured graphs
    gaps = _gaps(model, prompts, second, replay=True)
    assert float(gaps.mean()) < TOLERANCES[torch.bfloat16][0] and float(gaps.max()) < TOLERANCES[torch.bfloat16][1]
    assert [c.logprobs for c in second] != [c.logprobs for c in first]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_tokens_equal_the_transformers_engine_in_float32(name):
    new, old = greedy_tokens(MODELS[name](torch.float32), _prompts(6, seed=2))
    assert new == old


def test_auto_picks_the_decode_engine_for_lora_models():
    from agentrl.engines.factory import make_engine

    assert isinstance(make_engine(_gpt_oss(torch.bfloat16)), DecodeEngine)
