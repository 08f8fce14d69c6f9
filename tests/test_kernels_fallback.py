"""``backend="auto"`` survives a kernel that fails to compile or launch (issue 31): the Triton forward or
backward is made to raise Triton's compile errors, and the call still returns the reference's output,
LSE and gradients (d sink included) through the torch fallback, on every layout the kernels take, with
one warning per kernel and shape class and no second compile attempt; ``backend="triton"`` raises, and
input errors and CUDA out-of-memory errors are never swallowed. Also the decode engine's exact float32
kernel and its sink-attention calls over the slot cache. Runs on the CPU (the Triton kernels, where
they run at all, under the interpreter) in the default tier.
"""

from __future__ import annotations

import ast
import importlib
import warnings

import pytest
from _triton_device import DEV, torch  # first: sets TRITON_INTERPRET before triton loads

from agentrl.kernels import _torch_sink, fallback, sink_attention, sink_attention_reference  # noqa: E402

sink_module = importlib.import_module("agentrl.kernels.sink_attention")  # the module (the package exports the function)


def _compile_errors():
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    return {
        "CompilationError": CompilationError("def k(): ...", ast.parse("x = 1").body[0], "failed to legalize"),
        "OutOfResources": OutOfResources(262144, 232448, "shared memory"),
        "PassManager": RuntimeError("PassManager::run failed"),
    }


@pytest.fixture(autouse=True)
def _fresh_failures(monkeypatch):
    monkeypatch.setattr(fallback, "FAILED", {})
    monkeypatch.delenv("AGENTRL_SINK_BACKEND", raising=False)


class _Failing:
    """Stands in for a launch function: counts calls and raises ``exc``."""

    def __init__(self, exc: BaseException) -> None:
        self.exc, self.calls = exc, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        raise self.exc


def _inputs(layout: str, sinks: bool = True):
    g = torch.Generator().manual_seed(0)
    hq, hkv, d = 4, 2, 16
    rand = lambda *shape: torch.randn(*shape, generator=g).to(DEV)  # noqa: E731
    sink = rand(hq) if sinks else None
    if layout == "packed":  # an empty sequence, Nq < Nk, a sequence with more queries than keys
        kw = dict(cu_seqlens=torch.tensor([0, 3, 3, 8, 10], device=DEV),
                  cu_seqlens_k=torch.tensor([0, 5, 9, 14, 15], device=DEV))
        return (rand(10, hq, d), rand(15, hkv, d), rand(15, hkv, d), sink), kw
    return (rand(2, hq, 5, d), rand(2, hkv, 9, d), rand(2, hkv, 9, d), sink), {}


def _forward_backward(fn, tensors, **kw):
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in tensors]
    out, lse = fn(*leaves, return_lse=True, **kw)
    g = torch.Generator().manual_seed(1)
    up_out = torch.randn(out.shape, generator=g).to(DEV)
    up_lse = torch.randn(lse.shape, generator=g).to(DEV)
    finite = torch.isfinite(lse)  # rows that see nothing and have no sink: L = -inf
    loss = (out * up_out.to(out.dtype)).sum() + (torch.where(finite, lse, 0) * up_lse.to(lse.dtype)).sum()
    grads = torch.autograd.grad(loss, [t for t in leaves if t is not None])
    return out, torch.where(finite, lse, 0), grads


def _assert_equals_reference(tensors, tol=1e-5, **kw):
    got = _forward_backward(sink_attention, tensors, **kw)
    want = _forward_backward(sink_attention_reference, tensors, **kw)
    for a, b in zip((got[0], got[1], *got[2]), (want[0], want[1], *want[2]), strict=True):
        torch.testing.assert_close(a.double(), b.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("case", ["dense", "dense-window", "dense-no-sinks", "dense-not-causal", "packed",
                                  "packed-window", "packed-no-sinks", "packed-small-chunks"])
def test_the_torch_fallback_equals_the_reference_on_every_layout(monkeypatch, case):
    """Forward fails -> torch fallback: out, LSE and every gradient equal the float64 reference."""
    layout = "packed" if case.startswith("packed") else "dense"
    if case.endswith("small-chunks"):  # chunks of a few sequences, heads and query rows at once
        monkeypatch.setattr(_torch_sink, "CHUNK_ELEMENTS", 40)
    monkeypatch.setattr(sink_module, "_launch_fwd", _Failing(RuntimeError("PassManager::run failed")))
    tensors, kw = _inputs(layout, sinks="no-sinks" not in case)
    if "window" in case:
        kw["window"] = 3
    if case == "dense-not-causal":
        kw["causal"] = False
    with pytest.warns(fallback.KernelFallbackWarning):
        _assert_equals_reference(tensors, **kw)


@pytest.mark.parametrize("error", ["CompilationError", "OutOfResources", "PassManager"])
def test_auto_falls_back_once_when_the_forward_fails_to_compile(monkeypatch, error):
    exc = _compile_errors()[error]
    failing = _Failing(exc)
    monkeypatch.setattr(sink_module, "_launch_fwd", failing)
    tensors, kw = _inputs("dense")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            _assert_equals_reference(tensors, **kw)
    ours = [w for w in caught if issubclass(w.category, fallback.KernelFallbackWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert type(exc).__name__ in str(ours[0].message) and "forward" in str(ours[0].message)
    assert failing.calls == 1  # later calls of the shape class go straight to the fallback
    with pytest.raises(type(exc)):
        sink_attention(*tensors, backend="triton")


def test_auto_recomputes_the_gradients_when_the_backward_fails_to_compile(monkeypatch):
    """The forward runs our kernel; its backward fails inside autograd and the gradients come from an
    exact recomputation (LSE and d sink included)."""
    exc = _compile_errors()["CompilationError"]
    failing = _Failing(exc)
    monkeypatch.setattr(sink_module, "_launch_bwd", failing)
    real_fwd, fwd_calls = sink_module._launch_fwd, []
    monkeypatch.setattr(sink_module, "_launch_fwd", lambda *a: fwd_calls.append(1) or real_fwd(*a))
    tensors, kw = _inputs("packed")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            _assert_equals_reference(tensors, tol=1e-4, **kw)
    ours = [w for w in caught if issubclass(w.category, fallback.KernelFallbackWarning)]
    assert len(ours) == 1 and "backward" in str(ours[0].message)
    assert failing.calls == 1 and len(fwd_calls) == 2  # the forward kernel still runs
    with pytest.raises(type(exc)):
        _forward_backward(sink_attention, tensors, backend="triton", **kw)


@pytest.mark.parametrize("exc", [ValueError("bad input"), torch.cuda.OutOfMemoryError("CUDA out of memory"),
                                 fallback.KernelSetupError("needs Triton")])
def test_input_errors_and_out_of_memory_are_not_swallowed(monkeypatch, exc):
    monkeypatch.setattr(sink_module, "_launch_fwd", _Failing(exc))
    tensors, kw = _inputs("dense")
    with pytest.raises(type(exc)):
        sink_attention(*tensors, **kw)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="window"):  # the inputs' own check, before any kernel
        sink_attention(*tensors, window=0)
    assert not fallback.FAILED


def test_the_engine_falls_back_from_a_failing_kernel(monkeypatch):
    """KernelAttention over the slot cache (gap sequences, as inside a CUDA graph) and the exact decode
    kernel: a compile failure gives TorchAttention's result, one warning each."""
    import agentrl.engines.decode.decode_attention as exact_module
    from agentrl.engines.decode.slot_attention import KernelAttention, TorchAttention
    from agentrl.engines.decode.slot_cache import SlotCache

    hq, hkv, d, length, slots = 4, 2, 16, 16, 5
    caches = {lay: SlotCache(layers=1, kv_heads=hkv, head_dim=d, dtype=torch.float32, device=DEV, layout=lay)
              for lay in ("token", "head")}
    for c in caches.values():
        c.reserve(slots, length)
    kv = torch.randn(caches["token"].kv.shape, device=DEV)
    caches["token"].kv.copy_(kv)
    caches["head"].kv.copy_(kv.transpose(3, 4))
    sink = torch.randn(hq, device=DEV)
    n_keys = torch.tensor([7, 1, 12, 1, 15], device=DEV)
    q = torch.randn(slots, hq, d, device=DEV)
    want = TorchAttention(caches["head"]).decode(0, q, slots, n_keys, length, sinks=sink, window=3, scale=0.25)
    monkeypatch.setattr(sink_module, "_launch_fwd", _Failing(_compile_errors()["OutOfResources"]))
    monkeypatch.setattr(exact_module, "decode_attention", _Failing(_compile_errors()["CompilationError"]))
    arange = torch.arange(slots, device=DEV)
    cu = KernelAttention.bounds(arange, torch.ones_like(arange), n_keys, length)
    exact = TorchAttention(caches["head"], exact_kernel=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            got = KernelAttention(caches["token"])(0, q, cu, 1, sinks=sink, window=3, scale=0.25)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            got = exact.decode(0, q, slots, n_keys, length, sinks=sink, window=3, scale=0.25)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    ours = [w for w in caught if issubclass(w.category, fallback.KernelFallbackWarning)]
    assert len(ours) == 2, [str(w.message) for w in caught]
