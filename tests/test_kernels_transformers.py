"""Sink attention registered as a transformers attention implementation, on a tiny random GPT-OSS.

Without CUDA the kernels run under ``TRITON_INTERPRET=1`` (set before triton is imported; see
test_kernels_sink_attention.py) in fp32, so logits and gradients must match eager closely.
"""

from __future__ import annotations

import pytest
from _triton_device import CUDA, DEV, torch  # first: sets TRITON_INTERPRET before triton loads

transformers = pytest.importorskip("transformers")

from agentrl.kernels import register_transformers_attention  # noqa: E402

pytestmark = pytest.mark.kernels  # the Triton kernels' tier; one smoke case stays in the default tier

# On a GPU the kernels' fp32 dots run as TF32, eager's as fp32; on the CPU both are exact fp32.
TOL = 5e-3 if CUDA else 1e-5
GRAD_TOL = 2e-2 if CUDA else 1e-4
NAME = register_transformers_attention("agentrl_sink")


def _config(attn: str):
    cfg = transformers.GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=64,
        rope_parameters={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0},
    )
    cfg._attn_implementation = attn
    return cfg


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    eager = transformers.GptOssForCausalLM(_config("eager")).to(DEV).float().eval()
    with torch.no_grad():  # large sinks, so that a kernel ignoring them would fail
        for layer in eager.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(4) * 3)
    ours = transformers.GptOssForCausalLM(_config(NAME)).to(DEV).float().eval()
    ours.load_state_dict(eager.state_dict())
    return eager, ours


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.smoke
def test_logits_and_gradients_match_eager(models):
    eager, ours = models
    ids = torch.randint(0, 128, (2, 11), device=DEV)
    results = []
    for model in (eager, ours):
        model.zero_grad()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out.logits.detach(), grads))
    (le, ge), (lo, go) = results
    assert _rel(lo, le) < TOL
    assert ge.keys() == go.keys() and any("sinks" in n for n in go)
    bad = {n: _rel(go[n], ge[n]) for n in ge if _rel(go[n], ge[n]) > GRAD_TOL}
    assert not bad, bad


def test_left_padding_matches_eager_on_real_tokens(models):
    eager, ours = models
    ids = torch.randint(0, 128, (2, 10), device=DEV)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    le = eager(input_ids=ids, attention_mask=mask).logits
    lo = ours(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    assert _rel(lo[keep], le[keep]) < TOL


def test_generation_with_kv_cache_matches_eager(models):
    eager, ours = models
    ids = torch.randint(0, 128, (2, 6), device=DEV)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=7, do_sample=False,
              output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    ge = eager.generate(**kw)
    go = ours.generate(**kw)
    assert torch.equal(ge.sequences, go.sequences)
    assert _rel(torch.stack(go.scores), torch.stack(ge.scores)) < TOL


def test_packed_position_ids_match_separate_sequences(models):
    eager, ours = models
    a = torch.randint(0, 128, (1, 7), device=DEV)
    b = torch.randint(0, 128, (1, 5), device=DEV)
    packed = torch.cat([a, b], dim=1)
    pos = torch.cat([torch.arange(7), torch.arange(5)])[None].to(DEV)
    lo = ours(input_ids=packed, position_ids=pos).logits
    la = eager(input_ids=a).logits
    lb = eager(input_ids=b).logits
    assert _rel(lo, torch.cat([la, lb], dim=1)) < TOL


def test_from_pretrained_selects_the_implementation(models, tmp_path):
    eager, _ = models
    eager.save_pretrained(tmp_path)
    loaded = transformers.GptOssForCausalLM.from_pretrained(tmp_path, attn_implementation=NAME)
    assert loaded.config._attn_implementation == NAME
    ids = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        assert _rel(loaded.to(DEV)(input_ids=ids.to(DEV)).logits, eager(input_ids=ids.to(DEV)).logits) < TOL


def test_custom_4d_mask_is_refused_with_a_clear_error(models):
    _, ours = models
    ids = torch.randint(0, 128, (1, 5), device=DEV)
    mask4d = torch.zeros(1, 1, 5, 5, device=DEV)
    with pytest.raises(ValueError, match="2-D padding mask"):
        ours(input_ids=ids, attention_mask=mask4d)
