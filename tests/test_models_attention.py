"""The CPU grouped-query SDPA path gives transformers' ``sdpa`` results (forward and backward) on padded
batches, and load_model switches CPU GQA models to it."""

from __future__ import annotations

import pytest
from _tiny_llama import tiny_llama

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from agentrl.models.attention import NAME, use_gqa_sdpa  # noqa: E402


def _model(kv_heads: int):
    model = tiny_llama(0, vocab=97, hidden=48, intermediate=64, layers=2, heads=6, kv_heads=kv_heads, positions=128)
    model.set_attn_implementation("sdpa")
    return model


def _run(model, ids, att):
    model.zero_grad()
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=att, position_ids=pos).logits
    logits[att.bool()].pow(2).mean().backward()
    return logits.detach()[att.bool()], [p.grad.clone() for p in model.parameters()]


def test_same_results_as_sdpa_with_padding():
    model = _model(kv_heads=2)
    ids = torch.randint(0, 97, (3, 21), generator=torch.Generator().manual_seed(1))
    att = torch.ones(3, 21, dtype=torch.long)
    att[0, :6] = 0
    att[2, :2] = 0
    ref_logits, ref_grads = _run(model, ids, att)
    assert use_gqa_sdpa(model) and model.config._attn_implementation == NAME
    logits, grads = _run(model, ids, att)
    assert torch.equal(logits, ref_logits)
    for a, b in zip(grads, ref_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-7, rtol=1e-5)


def test_only_grouped_query_models_switch():
    assert not use_gqa_sdpa(_model(kv_heads=6))  # plain multi-head attention: nothing to gain
    model = _model(kv_heads=3)
    model.set_attn_implementation("eager")
    assert not use_gqa_sdpa(model)  # an explicit choice other than sdpa is kept
