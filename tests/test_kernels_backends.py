"""The backends of ``sink_attention`` ("triton", "fa4", "auto"): dispatch rules on any machine, and on
a CUDA GPU the same function from every backend against the float64 reference.

CPU (CI): the dispatch table, the errors of a backend that cannot run, the environment default, and
``auto`` falling back to our kernel under the interpreter. GPU: random odd shapes (N not a multiple
of any tile, GQA groups 1-8, head_dim 64 and 128, windows from 1 to N, decode, chunks against a
longer cache, packed batches with empty sequences and rows without keys, non-contiguous inputs,
non-causal), bf16 and fp16, comparing out, LSE, dq, dk, dv and d sink for each backend. The FA4
cases skip unless ``flash-attn-4`` is installed and the GPU is SM90/SM100.
"""

from __future__ import annotations

import sys

import pytest
from _triton_device import CUDA, DEV, torch  # first: sets TRITON_INTERPRET before triton loads

from agentrl.kernels import _dispatch, _fa4, sink_attention, sink_attention_reference  # noqa: E402


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------ dispatch rules (any machine)


def _choose(backend="auto", *, window=None, n_q=4096, n_k=4096, group=8, causal=True, needs_grad=True,
            dtype=torch.bfloat16, head_dim=64, interpreting=False):
    q = torch.empty(1, dtype=dtype)
    return _dispatch.choose(backend, q=q, head_dim=head_dim, sinks=None, causal=causal, window=window,
                            n_q=n_q, n_k=n_k, group=group, needs_grad=needs_grad, interpreting=interpreting)


def test_auto_follows_the_measured_table_when_fa4_can_run(monkeypatch):
    monkeypatch.setattr(_fa4, "unsupported_reason", lambda *a, **k: None)
    assert _choose(window=None, n_k=16384) == "fa4"  # full causal: FA4 measured faster
    assert _choose(window=128, n_k=16384) == "triton"  # GPT-OSS sliding window: ours
    assert _choose(window=128, n_k=16384, needs_grad=False) == "triton"
    assert _choose(window=256, n_k=16384) == "triton"  # between 128 and 512: interpolated, still ours
    assert _choose(window=512, n_k=16384) == "fa4"  # FA4 measured faster from about 400 keys on
    assert _choose(window=2048, n_q=2048, n_k=2048) == "fa4"
    assert _choose(window=20000, n_k=16384) == "fa4"  # a window covering every key is full attention
    assert _choose(window=None, n_q=1, n_k=16384) == "triton"  # decoding
    assert _choose(window=None, causal=False) == "triton"  # not measured: ours
    assert _choose("triton", window=None, n_k=16384) == "triton"
    assert _choose("fa4", window=128) == "fa4"


def test_measured_ratio_interpolates_between_measured_windows():
    fwd_128, bwd_128 = _dispatch.MEASURED[(128, 16384)]
    fwd_512, bwd_512 = _dispatch.MEASURED[(512, 16384)]
    fwd_256, bwd_256 = _dispatch.measured_ratio(256, 16384)
    assert fwd_256 == pytest.approx((fwd_128 + fwd_512) / 2) and bwd_256 == pytest.approx((bwd_128 + bwd_512) / 2)
    assert _dispatch.measured_ratio(1, 16384) == _dispatch.MEASURED[(128, 16384)]
    assert _dispatch.measured_ratio(10**6, 16384) == _dispatch.MEASURED[(None, 16384)]
    assert _dispatch.measured_ratio(None, 3000) == _dispatch.MEASURED[(None, 4096)]


def test_auto_uses_ours_where_fa4_cannot_run(monkeypatch):
    # CPU tensors: FA4 needs CUDA. auto falls back, an explicit fa4 says why.
    assert _choose(window=None, n_k=16384) == "triton"
    with pytest.raises(RuntimeError, match=r"backend='fa4'\) cannot run this call: FA4 runs on CUDA"):
        _choose("fa4")
    assert _choose(interpreting=True) == "triton"
    with pytest.raises(RuntimeError, match="interpreter"):
        _choose("fa4", interpreting=True)
    with pytest.raises(ValueError, match="backend must be one of"):
        _choose("flash")


def test_fa4_reasons_for_dtype_and_head_dim(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(_fa4, "_capability", lambda index: (9, 0))
    cuda0 = torch.device("cuda", 0)
    fake = SimpleNamespace(is_cuda=True, device=cuda0, dtype=torch.float32)
    assert "fp16/bf16" in _fa4.unsupported_reason(fake, 64, None, True, None)
    half = SimpleNamespace(is_cuda=True, device=cuda0, dtype=torch.bfloat16)
    assert "head_dim" in _fa4.unsupported_reason(half, 260, None, True, None)
    monkeypatch.setattr(_fa4, "_capability", lambda index: (8, 0))
    assert "SM90" in _fa4.unsupported_reason(half, 64, None, True, None)


def test_backend_argument_and_environment_default(monkeypatch):
    torch.manual_seed(0)
    q = torch.randn(1, 4, 9, 16, device=DEV)
    k = torch.randn(1, 2, 9, 16, device=DEV)
    v = torch.randn(1, 2, 9, 16, device=DEV)
    s = torch.randn(4, device=DEV)
    ours = sink_attention(q, k, v, s, backend="triton")
    assert torch.equal(sink_attention(q, k, v, s, backend="auto"), ours)  # fp32: never FA4
    monkeypatch.setenv("AGENTRL_SINK_BACKEND", "triton")
    assert torch.equal(sink_attention(q, k, v, s), ours)
    monkeypatch.setenv("AGENTRL_SINK_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="AGENTRL_SINK_BACKEND"):
        sink_attention(q, k, v, s)
    monkeypatch.delenv("AGENTRL_SINK_BACKEND")
    with pytest.raises(ValueError, match="backend must be one of"):
        sink_attention(q, k, v, s, backend="cudnn")
    with pytest.raises(RuntimeError, match=r"backend='fa4'\) cannot run"):
        sink_attention(q, k, v, s, backend="fa4")


def test_transformers_registration_takes_a_backend():
    pytest.importorskip("transformers")
    from transformers import AttentionInterface

    from agentrl.kernels import register_transformers_attention

    name = register_transformers_attention("agentrl_sink_test_triton", backend="triton")
    assert AttentionInterface()[name].keywords == {"backend": "triton"}
    with pytest.raises(ValueError, match="backend must be one of"):
        register_transformers_attention("agentrl_sink_bad", backend="flash")


# ------------------------------------------------------------------ GPU parity with the reference

# (id, batch, hkv, group, n_q, n_k, head_dim, window, causal, dtype, layout)
# layout: "dense" [B, H, N, D] contiguous; "bnhd" [B, N, H, D] memory seen as [B, H, N, D];
# "sliced" every other D-row of a wider tensor (non-contiguous, last dim contiguous);
# "packed:<q lens>[/<k lens>]" cu_seqlens batches (empty sequences, rows without keys).
CASES = [
    ("full_odd_g8", 2, 8, 8, 333, 333, 64, None, True, torch.bfloat16, "dense"),
    ("win128_bnhd_g8", 1, 8, 8, 517, 517, 64, 128, True, torch.bfloat16, "bnhd"),
    ("win1_g8", 1, 8, 8, 129, 129, 64, 1, True, torch.bfloat16, "dense"),
    ("chunk_vs_cache_g8", 1, 8, 8, 77, 301, 64, None, True, torch.bfloat16, "sliced"),
    ("chunk_win50_g8", 1, 8, 8, 77, 301, 64, 50, True, torch.bfloat16, "dense"),
    ("decode_g8", 3, 8, 8, 1, 1025, 64, None, True, torch.bfloat16, "dense"),
    ("decode_win128_g8", 3, 8, 8, 1, 1025, 64, 128, True, torch.bfloat16, "dense"),
    ("packed_empty_g8", 1, 8, 8, 0, 0, 64, None, True, torch.bfloat16, "packed:0,1,300,0,129,64"),
    ("packed_empty_win128_g8", 1, 8, 8, 0, 0, 64, 128, True, torch.bfloat16, "packed:0,1,300,0,129,64"),
    ("winN_d128_g3", 2, 2, 3, 200, 200, 128, 200, True, torch.float16, "dense"),
    ("win37_d128_g3_bnhd", 2, 2, 3, 301, 301, 128, 37, True, torch.float16, "bnhd"),
    ("full_d128_g1", 1, 4, 1, 250, 250, 128, None, True, torch.bfloat16, "dense"),
    ("full_g5_fp16", 1, 1, 5, 150, 150, 64, None, True, torch.float16, "dense"),
    ("win64_d128_g7", 1, 1, 7, 97, 97, 128, 64, True, torch.bfloat16, "sliced"),
    ("packed_nokeys_g2_fp16", 1, 2, 2, 0, 0, 64, None, True, torch.float16, "packed:3,0,50/10,5,40"),
    ("noncausal_g8", 1, 8, 8, 100, 120, 64, None, False, torch.bfloat16, "dense"),
]
TOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2}


def _make(case, seed):
    _, b, hkv, group, n_q, n_k, d, window, causal, dtype, layout = case
    hq = hkv * group
    g = torch.Generator(device=DEV).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, device=DEV, dtype=dtype, generator=g)

    kw = dict(causal=causal, window=window)
    if layout.startswith("packed:"):
        spec = layout.split(":", 1)[1]
        q_lens = [int(x) for x in spec.split("/")[0].split(",")]
        k_lens = [int(x) for x in spec.split("/")[1].split(",")] if "/" in spec else q_lens
        cu_q = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEV)
        cu_k = torch.tensor([0] + list(torch.tensor(k_lens).cumsum(0)), dtype=torch.int32, device=DEV)
        q, k, v = rnd(sum(q_lens), hq, d), rnd(sum(k_lens), hkv, d), rnd(sum(k_lens), hkv, d)
        kw.update(cu_seqlens=cu_q, cu_seqlens_k=cu_k if "/" in spec else None)
    elif layout == "bnhd":
        q = rnd(b, n_q, hq, d).transpose(1, 2)
        k = rnd(b, n_k, hkv, d).transpose(1, 2)
        v = rnd(b, n_k, hkv, d).transpose(1, 2)
    elif layout == "sliced":
        q = rnd(b, hq, n_q, 2, d)[:, :, :, 1]
        k = rnd(b, hkv, n_k, 2, d)[:, :, :, 0]
        v = rnd(b, hkv, n_k, 2, d)[:, :, :, 1]
    else:
        q, k, v = rnd(b, hq, n_q, d), rnd(b, hkv, n_k, d), rnd(b, hkv, n_k, d)
    sinks = torch.randn(hq, device=DEV, generator=g) * 3
    return (q, k, v, sinks), kw


def _errors(backend, inputs, kw, seed):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out, lse = sink_attention(*leaves, return_lse=True, backend=backend, **kw)
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    g_out = torch.randn(out.shape, device=DEV, generator=g, dtype=torch.float64)
    g_lse = torch.randn(lse.shape, device=DEV, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * g_out).sum() + (lse.double() * g_lse).sum(), leaves)
    ref_leaves = [t.detach().clone().requires_grad_() for t in inputs]
    ref_out, ref_lse = sink_attention_reference(*ref_leaves, return_lse=True, **kw)
    ref_grads = torch.autograd.grad((ref_out * g_out).sum() + (ref_lse * g_lse).sum(), ref_leaves)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    errs = {"out": _rel(out, ref_out), "lse": _rel(lse, ref_lse)}
    for name, a, r in zip(("dq", "dk", "dv", "dsink"), grads, ref_grads, strict=True):
        assert a.shape == r.shape and a.dtype == inputs[("dq", "dk", "dv", "dsink").index(name)].dtype
        errs[name] = _rel(a, r)
    return errs


def _fa4_skip_reason():
    if not CUDA:
        return "needs CUDA"
    q = torch.empty(1, device="cuda", dtype=torch.bfloat16)
    return _fa4.unsupported_reason(q, 64, None, True, None)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("backend", ["triton", "fa4", "auto"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_gpu_backend_matches_float64_reference(case, backend):
    if backend == "fa4" and _fa4_skip_reason() is not None:
        pytest.skip(_fa4_skip_reason())
    seed = 1000 + CASES.index(case)
    inputs, kw = _make(case, seed)
    errs = _errors(backend, inputs, kw, seed)
    tol = TOL[case[9]]
    print(f"PARITY {case[0]} {backend}: " + " ".join(f"{k}={v:.2e}" for k, v in errs.items()), file=sys.stderr)
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"{case[0]} backend={backend}: relative errors over {tol}: {bad} (all: {errs})"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_fa4_and_triton_agree_with_each_other():
    """Parity between the paths themselves at a GPT-OSS layer shape (bf16, 64/8 heads, d=64)."""
    if _fa4_skip_reason() is not None:
        pytest.skip(_fa4_skip_reason())
    for window in (None, 128):
        inputs, kw = _make(("gptoss", 1, 8, 8, 2047, 2047, 64, window, True, torch.bfloat16, "bnhd"), 7)
        outs = {}
        for backend in ("triton", "fa4"):
            leaves = [t.detach().clone().requires_grad_() for t in inputs]
            out, lse = sink_attention(*leaves, return_lse=True, backend=backend, **kw)
            grads = torch.autograd.grad(out.float().square().sum() + lse.sum(), leaves)
            outs[backend] = (out, lse, *grads)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dsink"), outs["triton"], outs["fa4"], strict=True):
            err = _rel(a, b)
            print(f"PARITY triton-vs-fa4 window={window} {name}={err:.2e}", file=sys.stderr)
            assert err < 2e-2, (window, name, err)
