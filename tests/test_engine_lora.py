"""The decode engine with the trainer's LoRA adapter (PEFT on the attention and GPT-OSS's fused experts) on the
CPU: unmerged deltas equal PEFT's forward, greedy tokens equal the transformers engine's, adapter updates are
seen without a rebuild, ``auto`` picks the decode engine for such a model on CUDA. The bf16 CUDA-graph versions
are in ``tests/test_engine_gpu.py``."""

from __future__ import annotations

import pytest
from _fixtures import randomize_adapters
from _tiny_llama import tiny_llama

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from agentrl.engines import factory  # noqa: E402
from agentrl.engines.base import SamplingParams  # noqa: E402
from agentrl.engines.decode.decode_engine import DecodeEngine  # noqa: E402
from agentrl.engines.decode.moe import SlotMoE  # noqa: E402
from agentrl.engines.transformers_engine import TransformersEngine  # noqa: E402
from agentrl.models.lora import LoraSpec, adapter_state_dict, adapters_disabled, apply_lora  # noqa: E402
from agentrl.models.routing import record_routing  # noqa: E402
from agentrl.models.tiny import tiny_gpt_oss  # noqa: E402

VOCAB = 300
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [12, 13], [20, 21, 22, 23], list(range(40, 80))]


def _randomize(model, seed: int) -> None:
    randomize_adapters(model, seed, scale=0.1)


def _lora_gpt_oss(seed: int = 5):
    model = tiny_gpt_oss(num_layers=2, hidden=64, experts=4, top_k=2, vocab=VOCAB, seed=1, sliding_window=6)
    apply_lora(model, LoraSpec(rank=4), seed=1)  # the defaults: q/k/v/o and both expert tensors
    _randomize(model, seed)
    return model


@pytest.fixture(scope="module")
def gpt_oss():
    return _lora_gpt_oss()


def _teacher_forced(model, prompt, completion, temperature=1.0):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    lp = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), -1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion)]


def test_the_adapter_wraps_attention_and_experts(gpt_oss):
    layer = gpt_oss.model.layers[0]
    assert type(layer.self_attn.q_proj).__name__ == "Linear" and hasattr(layer.self_attn.q_proj, "lora_A")
    assert type(layer.mlp.experts).__name__ == "ParamWrapper"
    moe = SlotMoE(layer.mlp)
    assert sorted(moe.lora) == ["down_proj", "gate_up_proj"] and type(moe.experts).__name__ == "GptOssExperts"


@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_expert_deltas_equal_peft_in_both_paths(gpt_oss, tokens):
    """The dense (CUDA-graph) and looped (prefill) expert paths equal PEFT's folded-weight forward; without the
    deltas they would not."""
    mlp = gpt_oss.model.layers[1].mlp
    h = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        ref = mlp(h[None])
        ref = (ref[0] if isinstance(ref, tuple) else ref).reshape(tokens, -1)
        with adapters_disabled(gpt_oss):
            base = mlp(h[None])
            base = (base[0] if isinstance(base, tuple) else base).reshape(tokens, -1)
    moe = SlotMoE(mlp)
    assert (ref - base).abs().max() > 1e-2
    for dense in (True, False):
        assert torch.allclose(moe(h, dense=dense), ref, atol=1e-5, rtol=1e-5)


def test_greedy_tokens_and_logprobs_equal_the_peft_model(gpt_oss):
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    old = TransformersEngine(gpt_oss).generate_sync(PROMPTS, greedy)
    new = DecodeEngine(gpt_oss, max_batch_size=3).generate_sync(PROMPTS, greedy)
    assert [c.token_ids for c in new] == [c.token_ids for c in old]
    for prompt, comp in zip(PROMPTS, new, strict=True):
        assert comp.logprobs == pytest.approx(_teacher_forced(gpt_oss, prompt, comp.token_ids), abs=1e-4)


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 5)])
def test_sampled_logprobs_equal_a_teacher_forced_peft_forward(gpt_oss, temperature, top_k):
    engine = DecodeEngine(gpt_oss, seed=3)
    params = SamplingParams(max_new_tokens=12, temperature=temperature, top_k=top_k)
    for prompt, comp in zip(PROMPTS, engine.generate_sync(PROMPTS, params), strict=True):
        assert len(comp.logprobs) == 12
        assert comp.logprobs == pytest.approx(_teacher_forced(gpt_oss, prompt, comp.token_ids, temperature), abs=1e-4)


def test_routing_is_recorded_through_the_adapter(gpt_oss):
    engine = DecodeEngine(gpt_oss, record_routing=True, seed=4)
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    for prompt, comp in zip(PROMPTS[:3], engine.generate_sync(PROMPTS[:3], params), strict=True):
        fed = prompt + comp.token_ids[:-1]
        with torch.no_grad(), record_routing(gpt_oss) as rec:
            gpt_oss(input_ids=torch.tensor([fed]))
        assert torch.equal(comp.routing, rec.routing()[:, 0])


def test_adapter_updates_are_seen_without_a_rebuild():
    """Both update routes: update_lora (a copy of the trainer's adapter) and an in-place write to the shared
    model (the trainer's optimizer step). The decoder and its modules stay the same objects."""
    model = _lora_gpt_oss(seed=5)
    engine = DecodeEngine(model, seed=2)
    decoder = engine.runner.decoder
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    prompts = PROMPTS[:2]

    def check(comps):
        for prompt, comp in zip(prompts, comps, strict=True):
            assert comp.logprobs == pytest.approx(_teacher_forced(model, prompt, comp.token_ids), abs=1e-4)

    first = engine.generate_sync(prompts, params)
    check(first)
    donor = _lora_gpt_oss(seed=6)
    engine.update_lora(adapter_state_dict(donor))
    second = engine.generate_sync(prompts, params)
    check(second)
    assert [c.logprobs for c in second] != [c.logprobs for c in first]
    _randomize(model, seed=7)  # in place, as an optimizer step writes
    check(engine.generate_sync(prompts, params))
    assert engine.runner.decoder is decoder


def test_transformers_engine_update_lora_copies_the_adapter_and_sets_the_version():
    """The transformers engine's update_lora (a rollout copy's adapter, asynchronous rollouts): the donor's adapter
    tensors land exactly, the version is set, and the next tokens carry it."""
    model = _lora_gpt_oss(seed=5)
    engine = TransformersEngine(model, seed=2)
    donor = _lora_gpt_oss(seed=6)
    engine.update_lora(adapter_state_dict(donor), version=4)
    assert engine.policy_version == 4
    copied, wanted = adapter_state_dict(model), adapter_state_dict(donor)
    assert copied.keys() == wanted.keys() and all(torch.equal(copied[k], wanted[k]) for k in wanted)
    (comp,) = engine.generate_sync(PROMPTS[:1], SamplingParams(max_new_tokens=4, temperature=1.0))
    assert comp.policy_versions == [4] * len(comp.token_ids)


def test_disabled_adapters_decode_the_base_model(gpt_oss):
    base = tiny_gpt_oss(num_layers=2, hidden=64, experts=4, top_k=2, vocab=VOCAB, seed=1, sliding_window=6)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    engine = DecodeEngine(gpt_oss)
    with adapters_disabled(gpt_oss):
        off = engine.generate_sync(PROMPTS, greedy)
    plain = DecodeEngine(base).generate_sync(PROMPTS, greedy)
    assert [c.token_ids for c in off] == [c.token_ids for c in plain]
    for a, b in zip(off, plain, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    on = engine.generate_sync(PROMPTS, greedy)  # enabled again: the adapter is back
    assert [c.logprobs for c in on] != [c.logprobs for c in off]


def test_update_lora_refuses_a_model_without_an_adapter():
    base = tiny_gpt_oss(num_layers=1, hidden=64, experts=4, top_k=2, vocab=VOCAB, seed=1)
    with pytest.raises(ValueError, match="carries no LoRA adapter"):
        DecodeEngine(base).update_lora({})


def test_auto_picks_the_decode_engine_for_a_lora_model_on_cuda(gpt_oss, monkeypatch):
    """The selection logic, with the device check answered "CUDA" (the real CUDA case is a GPU test)."""
    assert factory.choose_kind(gpt_oss) == "transformers"  # auto on the CPU
    monkeypatch.setattr(factory, "_on_cuda", lambda model: True)
    assert factory.choose_kind(gpt_oss) == "decode"
    assert factory.choose_kind(gpt_oss, "decode") == "decode"


def test_lora_variants_the_engine_cannot_compute_fall_back_with_the_reason(monkeypatch):
    from peft import LoraConfig, inject_adapter_in_model

    llama = tiny_llama(None, vocab=VOCAB, hidden=64, intermediate=96, heads=4, kv_heads=2, positions=512).eval()
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["q_proj"], lora_bias=True), llama)
    monkeypatch.setattr(factory, "_on_cuda", lambda model: True)
    assert factory.choose_kind(llama) == "transformers"
    with pytest.raises(ValueError, match="LoRA biases"):
        factory.choose_kind(llama, "decode")


def test_toggling_the_adapter_invalidates_captured_graphs_and_updates_do_not(gpt_oss):
    """What the runner keys graph recapture on (``moved``): enabling or disabling the adapter does, an in-place
    adapter write does not (it only refreshes the expert GEMM buffers, in place)."""
    from agentrl.engines.decode.decoder import SlotDecoder

    decoder = SlotDecoder(gpt_oss)
    decoder.weights_changed()
    decoder.sync_weights(rebuild=True)
    buffers = [(a.a_t, a.b_t) for lay in decoder.layers for a in lay.moe.lora.values()]
    with adapters_disabled(gpt_oss):
        assert decoder.weights_changed()[0]
    assert decoder.weights_changed()[0]  # enabled again
    with torch.no_grad():
        gpt_oss.model.layers[0].mlp.experts.lora_B["default"].weight.mul_(1.0)
    moved, updated = decoder.weights_changed()
    assert updated and not moved
    decoder.sync_weights()
    after = [(a.a_t, a.b_t) for lay in decoder.layers for a in lay.moe.lora.values()]
    assert all(x is y and u is v for (x, u), (y, v) in zip(after, buffers, strict=True))  # the same tensors
