"""Benchmark sink attention at GPT-OSS shapes on a CUDA GPU.

B=1, 64 query heads, 8 KV heads, head_dim 64, bf16, N in {2048, 8192, 16384}, causal full and
sliding window 128. Times, with the median of ``triton.testing.do_bench``:

* ours: ``agentrl.kernels.sink_attention`` (Triton, sinks included);
* flex: FlexAttention with the LSE rescale ``O = O_nosink * sigmoid(L_nosink - sigma)``, torch.compile'd;
* eager: transformers' GPT-OSS ``eager_attention_forward`` (N <= 8192: it materialises N^2 scores);
* sdpa: ``scaled_dot_product_attention`` without sinks (flash backend), full causal only, as the
  speed a sink-less kernel reaches.

Each is timed forward and forward+backward, with the peak extra memory of one forward+backward.
``--check`` first compares ours and flex against the float64 reference at N=2048 (bf16, rel. error),
plus decode (q_len 1) and packed cases and dsink determinism. ``--sweep`` times kernel tile configs.

Prints a table and, last, the line
``sink_attn: full16k_fwd_x_flex=<n> full16k_fwdbwd_x_flex=<n> win16k_fwd_x_flex=<n>
win16k_fwdbwd_x_flex=<n> fwd_tflops=<n>`` (speed-ups over flex; our full-causal 16k fwd TFLOP/s).

Usage: ``python benchmarks/sink_attention_bench.py [--check] [--sweep] [--ns 2048,8192,16384] [--out DIR]``
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from agentrl.kernels import sink_attention, sink_attention_reference
from agentrl.kernels.sink_attention import CONFIG_OVERRIDES, KernelConfig

HQ, HKV, D, WINDOW = 64, 8, 64, 128
DTYPE = torch.bfloat16


def _do_bench(fn, grad_to_none=None, rep=200):
    from triton.testing import do_bench

    return do_bench(fn, warmup=50, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def _inputs(n, requires_grad=True, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, HQ, n, D, device="cuda", dtype=DTYPE, generator=g)
    k = torch.randn(1, HKV, n, D, device="cuda", dtype=DTYPE, generator=g)
    v = torch.randn(1, HKV, n, D, device="cuda", dtype=DTYPE, generator=g)
    sinks = torch.randn(HQ, device="cuda", generator=g) * 3
    return [t.requires_grad_(requires_grad) for t in (q, k, v, sinks)]


def _pairs(n, window):
    """Number of visible (query, key) pairs."""
    if window is None:
        return n * (n + 1) // 2
    w = min(window, n)
    return w * (w + 1) // 2 + (n - w) * w


def _fwd_flops(n, window):
    return 4 * HQ * D * _pairs(n, window)


# ---------------------------------------------------------------- implementations


def ours(window):
    def f(q, k, v, s):
        return sink_attention(q, k, v, s, causal=True, window=window)
    return f


def _flex_sink(q, k, v, sinks, block_mask):
    from torch.nn.attention import flex_attention as fa

    if hasattr(fa, "AuxRequest"):
        out, aux = fa.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True,
                                     return_aux=fa.AuxRequest(lse=True))
        lse = aux.lse
    else:
        out, lse = fa.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True)
    return out * torch.sigmoid(lse - sinks[None, :, None])[..., None].to(out.dtype)


_FLEX_COMPILED = None


def flex(window, n):
    global _FLEX_COMPILED
    from torch.nn.attention.flex_attention import create_block_mask

    if _FLEX_COMPILED is None:
        torch._dynamo.config.cache_size_limit = 64  # one graph per (N, mask, grad mode)
        _FLEX_COMPILED = torch.compile(_flex_sink, dynamic=False)

    def mask_mod(b, h, q_idx, kv_idx):
        ok = q_idx >= kv_idx
        if window is not None:
            ok = ok & (q_idx - kv_idx < window)
        return ok

    block_mask = create_block_mask(mask_mod, 1, 1, n, n, device="cuda")

    def f(q, k, v, s):
        return _FLEX_COMPILED(q, k, v, s, block_mask)
    return f


def eager(window, n):
    try:
        from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward
    except ImportError:
        return None
    pos = torch.arange(n, device="cuda")
    ok = pos[None, :] <= pos[:, None]
    if window is not None:
        ok &= pos[None, :] > pos[:, None] - window
    mask = torch.zeros(n, n, device="cuda", dtype=DTYPE).masked_fill(~ok, torch.finfo(DTYPE).min)[None, None]

    class _Attn(torch.nn.Module):
        num_key_value_groups = HQ // HKV

    mod = _Attn()

    def f(q, k, v, s):
        mod.sinks = s
        return eager_attention_forward(mod, q, k, v, mask, scaling=1 / math.sqrt(D))[0]
    return f


def sdpa(window, expand_kv=False):
    """SDPA flash without sinks. ``expand_kv``: K/V repeated to 64 heads (MHA) in the timed region
    too, like a model that repeats them itself; otherwise ``enable_gqa=True``."""
    if window is not None:
        return None

    def f(q, k, v, s):
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            if expand_kv:
                k = k.repeat_interleave(HQ // HKV, dim=1)
                v = v.repeat_interleave(HQ // HKV, dim=1)
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return f


# ---------------------------------------------------------------- measurements


def measure(fn, n, with_bwd=True):
    q, k, v, s = _inputs(n)
    res = {}
    with torch.no_grad():
        res["fwd_ms"] = _do_bench(lambda: fn(q, k, v, s))
    if with_bwd:
        out = fn(q, k, v, s)
        g = torch.randn_like(out)

        def step():
            fn(q, k, v, s).backward(g)
        res["fwdbwd_ms"] = _do_bench(step, grad_to_none=[q, k, v, s])
        del out
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        res["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return res


def _rel(a, b):
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("nan")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(log):
    """Correctness at real shapes: ours and flex vs the float64 reference (bf16 inputs)."""
    ok = True
    n = 2048
    for window in (None, WINDOW):
        q, k, v, s = _inputs(n, seed=1)
        ref_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, s)]
        ref_out, ref_lse = sink_attention_reference(*ref_leaves, window=window, return_lse=True)
        g = torch.randn(ref_out.shape, device="cuda", dtype=torch.float64)
        gl = torch.randn(ref_lse.shape, device="cuda", dtype=torch.float64)
        ref_g = torch.autograd.grad((ref_out * g).sum() + (ref_lse * gl).sum(), ref_leaves)
        del ref_leaves
        out, lse = sink_attention(q, k, v, s, window=window, return_lse=True)
        got_g = torch.autograd.grad((out * g.to(DTYPE)).sum() + (lse * gl.float()).sum(), (q, k, v, s),
                                    retain_graph=True)
        errs = {"out": _rel(out, ref_out), "lse": _rel(lse, ref_lse)}
        errs.update({nm: _rel(a, b) for nm, a, b in zip(("dq", "dk", "dv", "dsink"), got_g, ref_g, strict=True)})
        # determinism of dsink (and dk/dv, no atomics anywhere)
        again = torch.autograd.grad((out * g.to(DTYPE)).sum() + (lse * gl.float()).sum(), (q, k, v, s))
        errs["dsink_bitwise_equal"] = bool(torch.equal(again[3], got_g[3]))
        with torch.no_grad():
            fo = flex(window, n)(q.detach(), k.detach(), v.detach(), s.detach())
        errs["flex_out"] = _rel(fo, ref_out)
        good = all(errs[nm] <= 1e-2 for nm in ("out", "lse", "dq", "dk", "dv", "dsink")) and errs["dsink_bitwise_equal"]
        ok &= good
        log(f"check N={n} window={window}: { {a: (f'{b:.2e}' if isinstance(b, float) else b) for a, b in errs.items()} } {'OK' if good else 'FAIL'}")
        del ref_out, ref_lse, ref_g
    # decode: q_len 1 against a KV cache
    for window in (None, WINDOW):
        q, k, v, s = _inputs(4097, requires_grad=False, seed=2)
        q1 = q[:, :, -1:].contiguous()
        out = sink_attention(q1, k, v, s, window=window)
        ref = sink_attention_reference(q1, k, v, s, window=window)
        e = _rel(out, ref)
        ok &= e <= 1e-2
        log(f"check decode Nk=4097 window={window}: out rel {e:.2e} {'OK' if e <= 1e-2 else 'FAIL'}")
    # packed variable-length
    lens = [0, 1, 1500, 129, 1, 3000]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    tot = int(cu[-1])
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(tot, HQ, D, device="cuda", dtype=DTYPE, generator=g).requires_grad_()
    k = torch.randn(tot, HKV, D, device="cuda", dtype=DTYPE, generator=g).requires_grad_()
    v = torch.randn(tot, HKV, D, device="cuda", dtype=DTYPE, generator=g).requires_grad_()
    s = (torch.randn(HQ, device="cuda", generator=g) * 3).requires_grad_()
    for window in (None, WINDOW):
        out = sink_attention(q, k, v, s, window=window, cu_seqlens=cu)
        go = torch.randn_like(out)
        gg = torch.autograd.grad((out * go).sum(), (q, k, v, s))
        ref = sink_attention_reference(q, k, v, s, window=window, cu_seqlens=cu)
        rg = torch.autograd.grad((ref * go.double()).sum(), (q, k, v, s))
        errs = [_rel(out, ref)] + [_rel(a, b) for a, b in zip(gg, rg, strict=True)]
        good = all(e <= 1e-2 for e in errs)
        ok &= good
        log(f"check packed lens={lens} window={window}: out,dq,dk,dv,dsink rel {[f'{e:.2e}' for e in errs]} {'OK' if good else 'FAIL'}")
    return ok


# (block_m, block_n, num_warps, num_stages, pack) per kernel, per case ("full" / "win")
SWEEP = {
    ("fwd", "full"): [(128, 128, 4, 3), (128, 64, 4, 3), (128, 128, 4, 4), (128, 128, 8, 3), (128, 64, 4, 2)],
    ("fwd", "win"): [(64, 32, 4, 3), (128, 32, 4, 3, True), (128, 64, 4, 3, True), (64, 32, 4, 3, True),
                     (128, 16, 4, 3, True), (64, 16, 4, 3, True), (128, 32, 8, 3, True)],
    ("dkdv", "full"): [(64, 64, 4, 3), (64, 64, 4, 4), (64, 64, 4, 2), (32, 64, 4, 3)],
    ("dkdv", "win"): [(32, 64, 4, 3), (64, 64, 4, 3, True), (128, 64, 4, 3, True), (128, 64, 8, 3, True),
                      (64, 32, 4, 3, True), (128, 32, 4, 3, True), (128, 128, 8, 3, True)],
    ("dq", "full"): [(64, 64, 4, 3), (128, 64, 4, 3), (64, 64, 4, 4)],
    ("dq", "win"): [(64, 32, 4, 3), (128, 32, 4, 3, True), (64, 32, 4, 3, True), (128, 64, 4, 3, True),
                    (128, 16, 4, 3, True)],
}


def sweep(log, deadline):
    """Time each kernel config at N=16384 (backward: total of the three backward kernels, varying one)."""
    from agentrl.kernels.sink_attention import _launch_bwd, _Layout

    results = []
    n = 16384
    for window in (WINDOW, None):
        case = "full" if window is None else "win"
        q, k, v, s = _inputs(n, requires_grad=False)
        out, lse = sink_attention(q, k, v, s, window=window, return_lse=True)
        do = torch.randn_like(out)
        lay = _Layout(False, 1, n, n, HQ, HKV, D)
        bwd_args = (do, q, k, v, s, out, lse, None, None, None, lay, True, window, 1 / math.sqrt(D))
        for kind in ("fwd", "dkdv", "dq"):
            for cfg in SWEEP[(kind, case)]:
                if time.time() > deadline:
                    return results
                CONFIG_OVERRIDES[kind] = KernelConfig(*cfg)
                if kind == "fwd":
                    fn = lambda q=q, k=k, v=v, s=s, w=window: sink_attention(q, k, v, s, window=w)  # noqa: E731
                else:
                    fn = lambda a=bwd_args: _launch_bwd(*a)  # noqa: E731
                try:
                    ms = _do_bench(fn, rep=100)
                except Exception as exc:  # a config can exceed shared memory or registers
                    ms = float("nan")
                    log(f"  {kind} {cfg} failed: {type(exc).__name__}: {str(exc)[:120]}")
                results.append((kind, case, cfg, ms))
                log(f"sweep {kind:4s} {case:4s} cfg={cfg}: {ms:.3f} ms{'' if kind == 'fwd' else ' (whole bwd)'}")
            CONFIG_OVERRIDES[kind] = None
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ns", default="2048,8192,16384")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-seconds", type=float, default=120)
    ap.add_argument("--skip", default="", help="comma-separated impls to skip (ours,flex,eager,sdpa)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sink_attention_bench needs a CUDA GPU")
    out_dir = Path(args.out) if args.out else None
    logf = open(out_dir / "bench_log.txt", "w") if out_dir else None

    def log(msg):
        print(msg, flush=True)
        if logf:
            logf.write(msg + "\n")
            logf.flush()

    import triton
    log(f"device={torch.cuda.get_device_name()} torch={torch.__version__} triton={triton.__version__}")
    t0 = time.time()
    if args.check:
        log(f"check: {'ALL OK' if check(log) else 'FAILURES'} ({time.time() - t0:.0f}s)")
    if args.sweep:
        sw = sweep(log, time.time() + args.sweep_seconds)
        if out_dir:
            (out_dir / "sweep.json").write_text(json.dumps(sw))
    skip = set(filter(None, args.skip.split(",")))
    rows = []
    for n in sorted((int(x) for x in args.ns.split(",")), reverse=True):
        for window in (None, WINDOW):
            case = "full" if window is None else f"win{WINDOW}"
            impls = [("ours", ours(window)), ("flex", None), ("eager", None), ("sdpa", sdpa(window)),
                     ("sdpa_x", sdpa(window, expand_kv=True))]
            for name, fn in impls:
                if name in skip:
                    continue
                if name == "flex":
                    fn = flex(window, n)
                if name == "eager":
                    fn = eager(window, n) if n <= 8192 else None
                if fn is None:
                    continue
                t1 = time.time()
                try:
                    r = measure(fn, n)
                except torch.cuda.OutOfMemoryError:
                    r = {"error": "OOM"}
                except Exception as exc:
                    r = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                torch.cuda.empty_cache()
                if "fwd_ms" in r:
                    r["fwd_tflops"] = _fwd_flops(n, window) / (r["fwd_ms"] * 1e-3) / 1e12
                r.update(impl=name, case=case, n=n)
                rows.append(r)
                log(f"{name:6s} {case:7s} N={n:6d} {json.dumps({a: (round(b, 4) if isinstance(b, float) else b) for a, b in r.items() if a not in ('impl', 'case', 'n')})} ({time.time() - t1:.0f}s)")
    if out_dir:
        (out_dir / "bench.json").write_text(json.dumps(rows, indent=1))

    def get(impl, case, n, key):
        for r in rows:
            if r["impl"] == impl and r["case"] == case and r["n"] == n and key in r:
                return r[key]
        return float("nan")

    log("")
    log(f"{'impl':6s} {'case':7s} {'N':>6s} {'fwd ms':>9s} {'fwd TF/s':>9s} {'fwd+bwd ms':>11s} {'peak MiB':>9s}")
    for r in rows:
        if "error" in r:
            log(f"{r['impl']:6s} {r['case']:7s} {r['n']:6d} {r['error']}")
            continue
        log(f"{r['impl']:6s} {r['case']:7s} {r['n']:6d} {r['fwd_ms']:9.3f} {r['fwd_tflops']:9.1f} "
            f"{r.get('fwdbwd_ms', float('nan')):11.3f} {r.get('peak_mib', float('nan')):9.0f}")
    n = 16384
    win = f"win{WINDOW}"
    print(
        f"sink_attn: full16k_fwd_x_flex={get('flex', 'full', n, 'fwd_ms') / get('ours', 'full', n, 'fwd_ms'):.2f} "
        f"full16k_fwdbwd_x_flex={get('flex', 'full', n, 'fwdbwd_ms') / get('ours', 'full', n, 'fwdbwd_ms'):.2f} "
        f"win16k_fwd_x_flex={get('flex', win, n, 'fwd_ms') / get('ours', win, n, 'fwd_ms'):.2f} "
        f"win16k_fwdbwd_x_flex={get('flex', win, n, 'fwdbwd_ms') / get('ours', win, n, 'fwdbwd_ms'):.2f} "
        f"fwd_tflops={get('ours', 'full', n, 'fwd_tflops'):.0f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
