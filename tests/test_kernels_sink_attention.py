"""Sink attention kernels against the float64 reference.

Without CUDA the Triton kernels run on the CPU under ``TRITON_INTERPRET=1`` (set here before the
kernels are first imported) on small odd shapes. bf16 is left to the GPU tests: Triton 3.9's
interpreter computes ``tl.dot`` on bf16 operands wrongly (an interpreter bug; fp16 and fp32 are
right), so the CPU cases use fp32 (near-exact) and fp16.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from _triton_device import CUDA, DEV, torch  # first: sets TRITON_INTERPRET before triton loads

from agentrl.kernels import sink_attention, sink_attention_eager, sink_attention_reference  # noqa: E402


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _compare(q, k, v, sinks, tol, **kw):
    """Run kernel and reference forward + backward (with an upstream dL) and compare everything."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    out, lse = sink_attention(*leaves, return_lse=True, backend="triton", **kw)  # ours, whatever auto picks
    g_out = torch.randn_like(out)
    g_lse = torch.randn_like(lse)
    grads = torch.autograd.grad((out * g_out).sum() + (lse * g_lse).sum(), leaves)
    ref_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    ref_out, ref_lse = sink_attention_reference(*ref_leaves, return_lse=True, **kw)
    ref_grads = torch.autograd.grad(
        (ref_out * g_out.double()).sum() + (ref_lse * g_lse.double()).sum(), ref_leaves)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    errs = {"out": _rel(out, ref_out), "lse": _rel(lse, ref_lse)}
    for name, g, rg in zip(("dq", "dk", "dv", "dsink"), grads, ref_grads, strict=True):
        errs[name] = _rel(g, rg)
    bad = {name: e for name, e in errs.items() if not e <= tol}
    assert not bad, f"relative errors over {tol}: {bad} (all: {errs})"
    return out, lse


def _dense(b, hq, hkv, n_q, n_k, d, sigma, dtype):
    q = torch.randn(b, hq, n_q, d, device=DEV, dtype=dtype)
    k = torch.randn(b, hkv, n_k, d, device=DEV, dtype=dtype)
    v = torch.randn(b, hkv, n_k, d, device=DEV, dtype=dtype)
    sinks = torch.randn(hq, device=DEV) * sigma
    return q, k, v, sinks


# fp32 is exact on the CPU interpreter; on GPUs the kernels' fp32 dots run as TF32.
FP32_TOL = 5e-3 if CUDA else 2e-5


@pytest.mark.parametrize(
    "b,hq,hkv,n,d,window,sigma",
    [
        pytest.param(2, 4, 4, 37, 16, None, 8.0, marks=pytest.mark.smoke),  # GQA 1, N not a multiple of the block, large |sigma|
        (1, 4, 2, 45, 32, 5, 0.1),  # GQA 2, window smaller than N, small |sigma|
        (1, 8, 1, 29, 16, 100, 4.0),  # GQA 8, window larger than N
        (1, 2, 1, 50, 16, 16, -6.0),  # window equal to the block, strongly negative sink
    ],
)
@pytest.mark.kernels
def test_dense_causal_matches_reference(b, hq, hkv, n, d, window, sigma):
    torch.manual_seed(n * 7 + hq)
    _compare(*_dense(b, hq, hkv, n, n, d, sigma, torch.float32), FP32_TOL, causal=True, window=window)


@pytest.mark.kernels
@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("hkv,window", [(1, None), (2, 6)])
def test_gqa_head_packed_tiles_match_reference(monkeypatch, pack, hkv, window):
    """Both tile layouts (one head per tile, or a GQA group's heads packed into the tile rows)."""
    from agentrl.kernels.sink_attention import CONFIG_OVERRIDES, KernelConfig

    cfg = KernelConfig(16, 16, 4, 1, pack)
    for kind in ("fwd", "dkdv", "dq"):
        monkeypatch.setitem(CONFIG_OVERRIDES, kind, cfg)
    torch.manual_seed(11)
    _compare(*_dense(1, 8, hkv, 27, 27, 16, 4.0, torch.float32), FP32_TOL, causal=True, window=window)
    lens = [5, 0, 1, 19]
    cu = torch.tensor([0, 5, 5, 6, 25], dtype=torch.int32, device=DEV)
    q = torch.randn(25, 8, 16, device=DEV)
    k = torch.randn(25, hkv, 16, device=DEV)
    v = torch.randn(25, hkv, 16, device=DEV)
    _compare(q, k, v, torch.randn(8, device=DEV) * 4, FP32_TOL, causal=True, window=window, cu_seqlens=cu,
             max_seqlen=max(lens))


@pytest.mark.kernels
@pytest.mark.parametrize("variant", ["tma", "atomic_dq", "atomic_dq_packed_heads", "tma_atomic_dq"])
@pytest.mark.parametrize("layout", ["dense", "packed", "dense_transposed"])
def test_kernel_variants_match_reference(monkeypatch, variant, layout):
    """Tiles through tensor descriptors (TMA: K/V in the forward and dQ kernels, q/dO in the dK/dV
    kernel) and dQ by atomics, on odd shapes: dense, packed with empty sequences, and [B, N, H, D]
    memory seen as [B, H, N, D]. (The interpreter has no bulk reductions: the GPU adds dQ by TMA
    in dense layouts, covered by the GPU tests.)"""
    from agentrl.kernels.sink_attention import CONFIG_OVERRIDES, KernelConfig

    pack = variant == "atomic_dq_packed_heads"
    cfg = KernelConfig(16, 16, 4, 1, pack, tma=variant.startswith("tma"), atomic_dq="atomic" in variant)
    for kind in ("fwd", "dkdv", "dq"):
        monkeypatch.setitem(CONFIG_OVERRIDES, kind, cfg)
    torch.manual_seed(13)
    for window in (None, 5):
        if layout == "packed":
            lens = [7, 0, 1, 21]
            cu = torch.tensor([0, 7, 7, 8, 29], dtype=torch.int32, device=DEV)
            q = torch.randn(29, 8, 16, device=DEV)
            k = torch.randn(29, 2, 16, device=DEV)
            v = torch.randn(29, 2, 16, device=DEV)
            _compare(q, k, v, torch.randn(8, device=DEV) * 4, FP32_TOL, causal=True, window=window,
                     cu_seqlens=cu, max_seqlen=max(lens))
        elif layout == "dense_transposed":
            q = torch.randn(2, 19, 8, 16, device=DEV).transpose(1, 2)
            k = torch.randn(2, 19, 2, 16, device=DEV).transpose(1, 2)
            v = torch.randn(2, 19, 2, 16, device=DEV).transpose(1, 2)
            _compare(q, k, v, torch.randn(8, device=DEV) * 4, FP32_TOL, causal=True, window=window)
        else:
            _compare(*_dense(1, 8, 2, 23, 23, 16, 4.0, torch.float32), FP32_TOL, causal=True, window=window)


@pytest.mark.kernels
def test_group_not_a_power_of_two_and_bf16_sinks():
    """GQA group of 3 (head packing must fall back to one head per tile); sinks stored in bf16."""
    torch.manual_seed(12)
    q, k, v, sinks = _dense(1, 6, 2, 23, 23, 16, 4.0, torch.float32)
    out, _ = _compare(q, k, v, sinks, FP32_TOL, causal=True, window=5)
    s16 = sinks.to(torch.bfloat16).requires_grad_()
    out16 = sink_attention(q, k, v, s16, window=5)
    (ds16,) = torch.autograd.grad(out16.sum(), s16)
    assert ds16.dtype == torch.bfloat16
    ref = sink_attention_reference(q, k, v, s16.detach().double().requires_grad_(), window=5)
    assert _rel(out16, ref) < FP32_TOL


@pytest.mark.kernels
def test_non_causal_matches_reference():
    torch.manual_seed(1)
    _compare(*_dense(1, 4, 2, 21, 21, 16, 3.0, torch.float32), FP32_TOL, causal=False)


@pytest.mark.kernels
def test_fp16_within_tolerance():
    torch.manual_seed(2)
    q, k, v, sinks = _dense(1, 4, 2, 40, 40, 32, 5.0, torch.float16)
    _compare(q, k, v, sinks, 5e-3, causal=True, window=9)


@pytest.mark.kernels
@pytest.mark.parametrize("n_k,window", [(45, None), (45, 7), (3, None)])
def test_decode_single_query_against_cache(n_k, window):
    torch.manual_seed(n_k)
    _compare(*_dense(2, 8, 1, 1, n_k, 16, 2.0, torch.float32), FP32_TOL, causal=True, window=window)


@pytest.mark.kernels
def test_chunk_of_queries_against_longer_cache():
    torch.manual_seed(3)
    _compare(*_dense(1, 4, 1, 19, 52, 16, 2.0, torch.float32), FP32_TOL, causal=True, window=20)


@pytest.mark.kernels
@pytest.mark.parametrize("window", [None, pytest.param(6, marks=pytest.mark.smoke)])
def test_packed_with_empty_and_single_token_sequences(window):
    torch.manual_seed(4)
    lens = [0, 1, 23, 0, 40, 1, 17]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEV)
    total, hq, hkv, d = int(cu[-1]), 4, 2, 16
    q = torch.randn(total, hq, d, device=DEV)
    k = torch.randn(total, hkv, d, device=DEV)
    v = torch.randn(total, hkv, d, device=DEV)
    sinks = torch.randn(hq, device=DEV) * 5
    _compare(q, k, v, sinks, FP32_TOL, causal=True, window=window, cu_seqlens=cu, max_seqlen=max(lens))


@pytest.mark.kernels
def test_packed_rows_without_keys_give_zero_output_and_sink_lse():
    """Rows before the first key (more queries than keys, bottom-right aligned) see only the sink."""
    torch.manual_seed(5)
    cu_q = torch.tensor([0, 6, 9], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, 2, 7], dtype=torch.int32, device=DEV)
    q = torch.randn(9, 2, 16, device=DEV)
    k = torch.randn(7, 2, 16, device=DEV)
    v = torch.randn(7, 2, 16, device=DEV)
    sinks = torch.tensor([3.0, -2.0], device=DEV)
    out, lse = _compare(q, k, v, sinks, FP32_TOL, causal=True, cu_seqlens=cu_q, cu_seqlens_k=cu_k)
    assert torch.equal(out[:4], torch.zeros_like(out[:4]))
    assert torch.allclose(lse[:, :4], sinks[:, None].expand(2, 4))


@pytest.mark.kernels
def test_without_sinks_is_plain_attention():
    torch.manual_seed(6)
    q, k, v, _ = _dense(1, 2, 1, 33, 33, 16, 0.0, torch.float32)
    out = sink_attention(q, k, v, None, window=10)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1),
        attn_mask=torch.ones(33, 33, dtype=torch.bool, device=DEV).tril().triu(-9))
    assert _rel(out, ref) < FP32_TOL


@pytest.mark.kernels
def test_dsink_is_deterministic_and_per_head():
    torch.manual_seed(7)
    q, k, v, sinks = _dense(2, 4, 1, 40, 40, 16, 3.0, torch.float32)
    sinks.requires_grad_()
    g = torch.randn(2, 4, 40, 16, device=DEV)
    first = torch.autograd.grad((sink_attention(q, k, v, sinks) * g).sum(), sinks)[0]
    second = torch.autograd.grad((sink_attention(q, k, v, sinks) * g).sum(), sinks)[0]
    assert torch.equal(first, second)
    assert first.shape == (4,) and len(set(first.tolist())) == 4


def test_eager_mirror_agrees_with_float64_reference():
    torch.manual_seed(8)
    q, k, v, sinks = _dense(1, 4, 2, 30, 30, 16, 6.0, torch.float32)
    eager = sink_attention_eager(q, k, v, sinks, window=8)
    ref = sink_attention_reference(q, k, v, sinks, window=8)
    assert _rel(eager, ref) < 1e-5


def test_bad_inputs_raise_clear_errors():
    q, k, v, sinks = _dense(1, 4, 3, 8, 8, 16, 1.0, torch.float32)
    with pytest.raises(ValueError, match="must divide"):
        sink_attention(q, k, v, sinks)
    q, k, v, sinks = _dense(1, 4, 2, 8, 8, 16, 1.0, torch.float32)
    with pytest.raises(ValueError, match="sinks must have shape"):
        sink_attention(q, k, v, sinks[:3])
    with pytest.raises(ValueError, match="window needs causal"):
        sink_attention(q, k, v, sinks, causal=False, window=4)
    with pytest.raises(ValueError, match="head_dim"):
        sink_attention(q[..., :12], k[..., :12], v[..., :12], sinks)
    with pytest.raises(ValueError, match="Nq <= Nk"):
        sink_attention(q, k[:, :, :4], v[:, :, :4], sinks)
    with pytest.raises(ValueError, match="one device"):
        sink_attention(q, k, v, sinks.to("meta"))


def test_import_without_triton_fails_only_on_call(tmp_path):
    script = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'triton' or name.startswith('triton.'):\n"
        "            raise ImportError('triton blocked for this test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch, agentrl.kernels as K\n"
        "x = torch.randn(1, 1, 4, 16)\n"
        "try:\n"
        "    K.sink_attention(x, x, x, torch.zeros(1))\n"
        "except RuntimeError as e:\n"
        "    print('ERR', e)\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "ERR" in res.stdout and "needs Triton" in res.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("window", [None, 128])
def test_gpu_real_shapes(dtype, tol, d, window):
    torch.manual_seed(9)
    _compare(*_dense(1, 64, 8, 1000, 1000, d, 4.0, dtype), tol, causal=True, window=window)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_packed_bf16():
    torch.manual_seed(10)
    lens = [0, 1, 700, 129, 1, 333]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEV)
    total = int(cu[-1])
    q = torch.randn(total, 64, 64, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(total, 8, 64, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(total, 8, 64, device=DEV, dtype=torch.bfloat16)
    sinks = torch.randn(64, device=DEV) * 4
    _compare(q, k, v, sinks, 1e-2, causal=True, window=128, cu_seqlens=cu)
