"""Real GPT-OSS checkpoints and the full-size shape, offline: an MXFP4 checkpoint in openai/gpt-oss's on-disk
format (built here from a tiny random model) loads dequantised and takes a LoRA adapter on its experts; and
GPT-OSS-20B's exact architecture (20.9B parameters, counted on the meta device) builds with random weights
through ``from_pretrained``'s meta-device path, scaled down here to run on the CPU."""

from __future__ import annotations

import json

import pytest
import torch

from agentrl.models import lora
from agentrl.models.gpt_oss_20b import count_parameters, gpt_oss_20b_config
from agentrl.models.loading import is_mxfp4, load_model
from agentrl.models.tiny import tiny_gpt_oss

FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """openai/gpt-oss's MXFP4 layout of an expert tensor ``[E, in, out]`` (the HF parameter layout): ``blocks``
    ``[E, out, in/32, 16]`` uint8, two E2M1 codes per byte (element ``2j`` in the low nibble), and ``scales``
    ``[E, out, in/32]`` uint8, the shared power-of-two exponent of each 32-element block plus 127 (E8M0)."""
    e, n_in, n_out = weight.shape
    groups = weight.transpose(1, 2).float().reshape(e, n_out, n_in // 32, 32)
    amax = groups.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.full_like(amax, -127.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    magnitude = (scaled.abs()[..., None] - FP4).abs().argmin(-1)
    codes = magnitude | (((scaled < 0) & (magnitude > 0)).long() << 3)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8).contiguous()


def dequantize_reference(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The MXFP4 format decoded element by element: ``[E, in, out]`` fp32."""
    e, n_out, groups, _ = blocks.shape
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(e, n_out, groups, 32).long()
    values = torch.where(codes >= 8, -1.0, 1.0) * FP4[codes & 7]
    values = values * torch.exp2(scales.float() - 127.0)[..., None]
    return values.reshape(e, n_out, groups * 32).transpose(1, 2)


TINY = {"num_layers": 2, "hidden": 64, "experts": 4, "top_k": 2, "vocab": 512, "seed": 3}


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    """``(directory, original model, {expert parameter name: reference dequantisation})``."""
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    directory = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    model = tiny_gpt_oss(**TINY)
    model.save_pretrained(directory)
    # a stand-in tokenizer file (loading a directory reads one; GPT-OSS's Harmony format brings its own)
    word_level = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    PreTrainedTokenizerFast(tokenizer_object=word_level).save_pretrained(directory)
    weights, stored, expected = load_file(directory / "model.safetensors"), {}, {}
    for name, tensor in weights.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(tensor)
            stored[name + "_blocks"], stored[name + "_scales"] = blocks, scales
            expected[name] = dequantize_reference(blocks, scales)
        else:
            stored[name] = tensor
    save_file(stored, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {  # as in openai/gpt-oss-20b's config.json
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"],
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory, model, expected


def test_lora_on_an_mxfp4_checkpoint_loaded_dequantised(mxfp4_checkpoint):
    directory, original, expected = mxfp4_checkpoint
    from transformers import AutoConfig

    assert is_mxfp4(AutoConfig.from_pretrained(directory)) and not is_mxfp4(original.config)
    loaded = load_model(str(directory), dtype="float32")
    assert loaded.format_name == "harmony"
    state, reference = loaded.model.state_dict(), original.state_dict()
    assert state.keys() == reference.keys()
    for name, tensor in state.items():
        assert tensor.dtype == torch.float32, name
        if name in expected:  # the experts: exactly the MXFP4 values, close to the weights they encode
            assert torch.equal(tensor, expected[name]), name
            assert float((tensor - reference[name]).abs().max()) < 0.25 * float(reference[name].abs().max())
        else:
            assert torch.equal(tensor, reference[name]), name
    # the same model, built from the decoded weights, gives the same log-probs; LoRA adapts the experts
    rebuilt = tiny_gpt_oss(**TINY)
    rebuilt.load_state_dict({**reference, **expected})
    ids = torch.tensor([[506, 9, 17, 3, 44, 2, 8, 61]])
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, rebuilt(ids).logits)
    counts = lora.apply_lora(loaded.model, lora.LoraSpec(rank=2))
    assert any("experts" in n for n, _ in lora.adapter_parameters(loaded.model)) and counts["trainable"] > 0
    loaded.model(ids).logits.sum().backward()
    assert all(p.grad is not None for _, p in lora.adapter_parameters(loaded.model))


SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2}


def test_lora_on_gpt_oss_20b_random_shape_built_through_the_meta_device():
    config = gpt_oss_20b_config()
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (24, 2880, 2880)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (64, 8, 64)
    assert (config.num_local_experts, config.num_experts_per_tok, config.vocab_size) == (32, 4, 201088)
    assert config.sliding_window == 128 and config.layer_types[:3] == ["sliding_attention", "full_attention",
                                                                       "sliding_attention"]
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["factor"] == 32.0
    assert count_parameters(config) == 20_914_757_184  # openai/gpt-oss-20b's 20.9B, on the meta device

    # the same builder, scaled down: `model=gpt-oss-20b-random model_kwargs.num_hidden_layers=2 ...`
    first = load_model("gpt-oss-20b-random", dtype="bfloat16", seed=4, model_kwargs=SMALL)
    again = load_model("gpt-oss-20b-random", dtype="bfloat16", seed=4, model_kwargs=SMALL)
    other = load_model("gpt-oss-20b-random", dtype="bfloat16", seed=5, model_kwargs=SMALL)
    model = first.model
    assert first.format_name == "harmony" and model.training and model.config.vocab_size == 201088
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    params = dict(model.named_parameters())
    assert all(torch.equal(p, params[n]) for n, p in again.model.named_parameters())
    assert not torch.equal(other.model.lm_head.weight, model.lm_head.weight)
    init_std = float(params["model.layers.0.mlp.experts.gate_up_proj"].detach().float().std())
    assert 0.015 < init_std < 0.025  # the model's own _init_weights: normal(0, 0.02)
    lora.apply_lora(model, lora.LoraSpec(rank=2))
    ids = torch.tensor([[200006, 9, 17, 3, 44]])
    model(ids).logits.float().sum().backward()
    assert all(p.grad is not None for _, p in lora.adapter_parameters(model))
