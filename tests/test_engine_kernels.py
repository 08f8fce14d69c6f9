"""The decode engine's GPU building blocks against their torch counterparts, on small shapes: the fused Triton
element-wise kernels, the sink-attention kernel over the slot cache (gap sequences between slots), the
dense (graph-friendly) MoE. On a machine without CUDA the Triton kernels run under ``TRITON_INTERPRET=1``
(set by ``tests/conftest.py``)."""

from __future__ import annotations

import os

import pytest
from _tiny_llama import tiny_llama

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from agentrl.engines.decode.moe import SlotMoE  # noqa: E402
from agentrl.engines.decode.slot_attention import KernelAttention, PrefillPlan, TorchAttention  # noqa: E402
from agentrl.engines.decode.slot_cache import SlotCache  # noqa: E402
from agentrl.models.tiny import tiny_gpt_oss  # noqa: E402

pytestmark = pytest.mark.kernels  # the Triton kernels' tier; one smoke case stays in the default tier

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)


@pytest.mark.parametrize("cast_first", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_residual_matches_transformers(cast_first, dtype):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from agentrl.engines.decode.fused_ops import rms_norm

    torch.manual_seed(0)
    norm = (LlamaRMSNorm if cast_first else GptOssRMSNorm)(48, eps=1e-5).to(DEVICE, dtype)
    norm.weight.data.normal_()
    x, r = (torch.randn(5, 48, device=DEVICE, dtype=dtype) for _ in range(2))
    y, s = rms_norm(x, norm.weight, 1e-5, residual=r, cast_first=cast_first)
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: a few units in the last place
    if DEVICE == "cuda":
        assert torch.equal(s, x + r)  # the interpreter's bf16 casts truncate; CUDA rounds like torch
    torch.testing.assert_close(s, x + r, atol=tol, rtol=tol)
    torch.testing.assert_close(y, norm(x + r), atol=tol, rtol=tol)
    y0, same = rms_norm(x, norm.weight, 1e-5, cast_first=cast_first)
    assert same is x
    torch.testing.assert_close(y0, norm(x), atol=tol, rtol=tol)


@pytest.mark.parametrize("layout", ["token", "head"])
def test_rope_store_rotates_and_stores_like_transformers(layout):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from agentrl.engines.decode.fused_ops import rope_store

    torch.manual_seed(1)
    n, hq, hkv, d, length = 4, 3, 1, 16, 12
    cache = SlotCache(layers=1, kv_heads=hkv, head_dim=d, dtype=torch.float32, device=DEVICE, layout=layout)
    cache.reserve(3, length)
    qkv = torch.randn(n, (hq + 2 * hkv) * d, device=DEVICE)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
    angles = torch.rand(length, d // 2, device=DEVICE) * 6
    cos_h, sin_h = angles.cos(), angles.sin()
    positions = torch.tensor([0, 5, 5, 11], device=DEVICE)
    slots = torch.tensor([0, 2, 1, 2], device=DEVICE)
    q_rot = rope_store(q, k, v, cos_h, sin_h, positions, positions, slots, cache.keys(0), cache.values(0), layout=layout)
    cos, sin = torch.cat([cos_h, cos_h], -1)[positions], torch.cat([sin_h, sin_h], -1)[positions]
    q_ref, k_ref = apply_rotary_pos_emb(q.reshape(n, hq, d), k.reshape(n, hkv, d), cos, sin)
    torch.testing.assert_close(q_rot, q_ref, atol=1e-5, rtol=1e-5)
    ref = SlotCache(layers=1, kv_heads=hkv, head_dim=d, dtype=torch.float32, device=DEVICE, layout=layout)
    ref.reserve(3, length)
    ref.write(0, slots, positions, k_ref, v.reshape(n, hkv, d))
    torch.testing.assert_close(cache.kv, ref.kv, atol=1e-5, rtol=1e-5)


def test_silu_mul_matches_the_llama_mlp_activation():
    from agentrl.engines.decode.fused_ops import silu_mul

    gate_up = torch.randn(3, 40, device=DEVICE)
    expected = torch.nn.functional.silu(gate_up[:, :20]) * gate_up[:, 20:]
    torch.testing.assert_close(silu_mul(gate_up), expected, atol=1e-5, rtol=1e-5)


def _filled_caches(slots: int, length: int, hkv: int, d: int):
    """Two caches (token and head layout) with the same random keys and values."""
    torch.manual_seed(2)
    kv = torch.randn(1, 2, slots, length, hkv, d, device=DEVICE)
    token = SlotCache(layers=1, kv_heads=hkv, head_dim=d, dtype=torch.float32, device=DEVICE, layout="token")
    head = SlotCache(layers=1, kv_heads=hkv, head_dim=d, dtype=torch.float32, device=DEVICE, layout="head")
    token.reserve(slots, length)
    head.reserve(slots, length)
    token.kv.copy_(kv)
    head.kv.copy_(kv.transpose(3, 4))
    return token, head


@pytest.mark.parametrize("window,sinks", [(None, False), (None, True), (3, True)])
def test_kernel_attention_over_slots_equals_torch_attention(window, sinks):
    hq, hkv, d, length = 4, 2, 16, 16
    token, head = _filled_caches(5, length, hkv, d)
    sink = torch.randn(hq, device=DEVICE) if sinks else None
    # decode: one query per slot 0..4, slot 3 not live (one key)
    n_keys = torch.tensor([7, 1, 12, 1, 15], device=DEVICE)
    q = torch.randn(5, hq, d, device=DEVICE)
    slots = torch.arange(5, device=DEVICE)
    cu = KernelAttention.bounds(slots, torch.ones_like(slots), n_keys, length)
    got = KernelAttention(token)(0, q, cu, 1, sinks=sink, window=window, scale=0.25)
    want = TorchAttention(head).decode(0, q, 5, n_keys, length, sinks=sink, window=window, scale=0.25)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    # prefill: rows in slots 1 and 4 with 3 and 5 new queries after 2 and 6 cached keys
    q = torch.randn(8, hq, d, device=DEVICE)
    cu = KernelAttention.bounds(torch.tensor([1, 4], device=DEVICE), torch.tensor([3, 5], device=DEVICE),
                                torch.tensor([5, 11], device=DEVICE), length)
    got = KernelAttention(token)(0, q, cu, 5, sinks=sink, window=window, scale=0.25)
    plan = PrefillPlan.build([1, 4], [3, 5], [5, 11], torch.device(DEVICE))
    want = TorchAttention(head).prefill(0, q, plan, sinks=sink, window=window, scale=0.25)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("window,sinks", [(None, False), (4, True)])
def test_exact_decode_kernel_equals_torch_attention(window, sinks):
    from agentrl.engines.decode.decode_attention import decode_attention

    hq, hkv, d, length = 6, 2, 16, 40
    _, head = _filled_caches(4, length, hkv, d)
    sink = torch.randn(hq, device=DEVICE) if sinks else None
    n_keys = torch.tensor([33, 1, 17, 40], device=DEVICE)
    q = torch.randn(4, hq, d, device=DEVICE)
    got = decode_attention(q, head.keys(0), head.values(0), torch.arange(4, device=DEVICE), n_keys,
                           sinks=sink, window=window, scale=0.25)
    want = TorchAttention(head).decode(0, q, 4, n_keys, length, sinks=sink, window=window, scale=0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_dense_moe_equals_the_per_expert_loop_and_transformers():
    model = tiny_gpt_oss(num_layers=1, hidden=32, experts=4, top_k=2, vocab=64, seed=3).to(DEVICE)
    mlp = model.model.layers[0].mlp
    moe = SlotMoE(mlp)
    h = torch.randn(9, 32, device=DEVICE)
    with torch.no_grad():
        dense, looped = moe(h, dense=True), moe(h, dense=False)
        reference = mlp(h[None])[0][0]
    torch.testing.assert_close(dense, looped, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(looped, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["exact", pytest.param("kernel", marks=pytest.mark.smoke)])
def test_the_engine_with_gpu_kernels_decodes_like_the_transformers_engine(attention):
    from agentrl.engines.base import SamplingParams
    from agentrl.engines.decode.decode_engine import DecodeEngine
    from agentrl.engines.transformers_engine import TransformersEngine

    model = tiny_llama(0, vocab=128, hidden=64, intermediate=96, layers=2, heads=4, kv_heads=2, positions=256)
    model = model.to(DEVICE).eval()
    prompts = [list(range(3, 25)), [5, 6], list(range(30, 70))]
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    old = TransformersEngine(model).generate_sync(prompts, greedy)
    new = DecodeEngine(model, attention=attention, fused=True, cuda_graphs=False).generate_sync(prompts, greedy)
    assert [c.token_ids for c in new] == [c.token_ids for c in old]
    for a, b in zip(old, new, strict=True):
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)


@pytest.mark.parametrize("name", ["llama", "gpt_oss"])
def test_fused_projections_add_the_lora_deltas(name):
    """With ``fused=True`` the q/k/v (and gate/up) copies hold the base weights; the adapter's deltas are added
    to their slices: the same tokens and log-probs as the PEFT model through the transformers engine."""

    pytest.importorskip("peft")
    from agentrl.engines.base import SamplingParams
    from agentrl.engines.decode.decode_engine import DecodeEngine
    from agentrl.engines.transformers_engine import TransformersEngine
    from agentrl.models.lora import LoraSpec, apply_lora

    torch.manual_seed(0)
    if name == "llama":
        model = tiny_llama(None, vocab=128, hidden=64, intermediate=96, layers=2, heads=4, kv_heads=2, positions=256)
        model = model.to(DEVICE).eval()
    else:
        model = tiny_gpt_oss(num_layers=2, hidden=64, experts=4, top_k=2, vocab=128, seed=1, sliding_window=6,
                             device=DEVICE)
    apply_lora(model, LoraSpec(rank=4), seed=1)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "lora_" in pname:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    prompts = [list(range(3, 25)), [5, 6], list(range(30, 70))]
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    old = TransformersEngine(model).generate_sync(prompts, greedy)
    new = DecodeEngine(model, attention="torch", fused=True, cuda_graphs=False).generate_sync(prompts, greedy)
    assert [c.token_ids for c in new] == [c.token_ids for c in old]
    for a, b in zip(old, new, strict=True):
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
