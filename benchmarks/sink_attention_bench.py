"""Sink attention on a CUDA GPU: our Triton kernels, FlashAttention-4 and ``backend="auto"`` side by
side in one process, at GPT-OSS shapes (64 query heads, 8 KV heads, head_dim 64, bf16, causal).

Cases: full causal and sliding window 128 at B=1, N=16384 and at B=4, N=4096, each forward and
forward+backward (``triton.testing.do_bench`` medians), plus the GPT-OSS layer mix: 24 attention
layers alternating window 128 and full, forward+backward of the whole stack (median of CUDA-event
timed steps). Paths:

* ``triton``: ``sink_attention(..., backend="triton")`` (ours);
* ``fa4``: ``backend="fa4"`` (``flash_attn.cute.flash_attn_func`` with ``learnable_sink``; needs
  ``pip install 'agentrl-sdk[fa4]'`` and an SM90/SM100 GPU);
* ``auto``: ``backend="auto"``, the per-call choice of ``agentrl.kernels._dispatch``;
* ``flex`` (``--flex``): FlexAttention, torch.compile'd, sinks through ``O * sigmoid(L - sigma)``.

Options: ``--check`` compares every path against the float64 reference first; ``--sweep`` times
tile/variant configurations of our kernels at N=16384 (each checked against the reference first) and
writes the fastest to ``--sweep-out`` (JSON for ``--configs`` / ``$AGENTRL_SINK_CONFIGS``);
``--table`` adds windows 512 and 2048 (the data of the dispatch table).

The last line (when FA4 ran) is
``sink_attn_vs_fa4: auto_full16k_fwd=<x> auto_full16k_fwdbwd=<x> auto_win16k_fwd=<x>
auto_win16k_fwdbwd=<x> auto_gptoss_mix_fwdbwd=<x> triton_full16k_fwd=<x> triton_full16k_fwdbwd=<x>``,
each FA4's time divided by the named path's time (> 1: faster than FA4).

Usage: ``python benchmarks/sink_attention_bench.py [--check] [--sweep] [--table] [--flex]
[--paths triton,fa4,auto] [--no-mix] [--configs F] [--out DIR]``
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from agentrl.kernels import sink_attention, sink_attention_reference

HQ, HKV, D, WINDOW = 64, 8, 64, 128
DTYPE = torch.bfloat16
CASES = [(1, 16384), (4, 4096)]  # (batch, tokens per sequence)
MIX_LAYERS = 24

_LOG = None


def log(msg: str) -> None:
    print(msg, flush=True)
    if _LOG is not None:
        _LOG.write(msg + "\n")
        _LOG.flush()


def _do_bench(fn, grad_to_none=None, rep=200):
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def _inputs(b, n, requires_grad=True, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, HQ, n, D, device="cuda", dtype=DTYPE, generator=g)
    k = torch.randn(b, HKV, n, D, device="cuda", dtype=DTYPE, generator=g)
    v = torch.randn(b, HKV, n, D, device="cuda", dtype=DTYPE, generator=g)
    sinks = torch.randn(HQ, device="cuda", generator=g) * 3
    return [t.requires_grad_(requires_grad) for t in (q, k, v, sinks)]


def _rel(a, b):
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("nan")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------- paths


def path_fn(name, window, b=1, n=16384):
    """f(q, k, v, sinks) -> out for one path and mask."""
    if name == "flex":
        return flex_fn(window, b, n)

    def f(q, k, v, s):
        return sink_attention(q, k, v, s, causal=True, window=window, backend=name)
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


def flex_fn(window, b, n):
    global _FLEX_COMPILED
    from torch.nn.attention.flex_attention import create_block_mask

    if _FLEX_COMPILED is None:
        torch._dynamo.config.cache_size_limit = 64
        _FLEX_COMPILED = torch.compile(_flex_sink, dynamic=False)

    def mask_mod(bi, h, q_idx, kv_idx):
        ok = q_idx >= kv_idx
        if window is not None:
            ok = ok & (q_idx - kv_idx < window)
        return ok

    block_mask = create_block_mask(mask_mod, None, None, n, n, device="cuda")

    def f(q, k, v, s):
        return _FLEX_COMPILED(q, k, v, s, block_mask)
    return f


# ---------------------------------------------------------------- measurements


def measure(fn, b, n):
    q, k, v, s = _inputs(b, n)
    res = {}
    with torch.no_grad():
        res["fwd_ms"] = _do_bench(lambda: fn(q, k, v, s))
    out = fn(q, k, v, s)
    g = torch.randn_like(out)
    del out
    res["fwdbwd_ms"] = _do_bench(lambda: fn(q, k, v, s).backward(g), grad_to_none=[q, k, v, s])
    return res


def measure_mix(path, b, n, steps=5):
    """Forward+backward of 24 layers alternating window 128 and full (each its own q/k/v/sinks):
    median ms of ``steps`` CUDA-event timed steps after 2 warm-up steps."""
    layers = []
    for i in range(MIX_LAYERS):
        window = WINDOW if i % 2 == 0 else None
        layers.append((path_fn(path, window, b, n), _inputs(b, n, seed=100 + i)))
    grads = torch.randn(b, HQ, n, D, device="cuda", dtype=DTYPE)

    def step():
        outs = [fn(*inp) for fn, inp in layers]
        torch.autograd.backward(outs, [grads] * len(outs))
        for _, inp in layers:
            for t in inp:
                t.grad = None

    times = []
    for i in range(steps + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    layers.clear()
    torch.cuda.empty_cache()
    return statistics.median(times)


# ---------------------------------------------------------------- correctness


def check(paths):
    """Every path against the float64 reference (bf16 inputs, sigma ~ 3 N(0,1), upstream dO and dL)."""
    ok = True
    for n, window, b in ((2047, None, 1), (2047, WINDOW, 1), (1000, None, 2)):
        q, k, v, s = _inputs(b, n, seed=1)
        ref_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, s)]
        ref_out, ref_lse = sink_attention_reference(*ref_leaves, window=window, return_lse=True)
        g = torch.randn(ref_out.shape, device="cuda", dtype=torch.float64)
        gl = torch.randn(ref_lse.shape, device="cuda", dtype=torch.float64)
        ref_g = torch.autograd.grad((ref_out * g).sum() + (ref_lse * gl).sum(), ref_leaves)
        del ref_leaves
        for path in paths:
            if path == "flex":
                continue
            try:
                leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, s)]
                out, lse = sink_attention(*leaves, window=window, return_lse=True, backend=path)
                got = torch.autograd.grad((out.double() * g).sum() + (lse.double() * gl).sum(), leaves)
                errs = {"out": _rel(out, ref_out), "lse": _rel(lse, ref_lse)}
                errs.update({nm: _rel(a, r) for nm, a, r in zip(("dq", "dk", "dv", "dsink"), got, ref_g, strict=True)})
            except Exception as exc:
                errs = {"error": float("nan")}
                log(f"check {path} raised {type(exc).__name__}: {str(exc)[:300]}")
            good = all(e <= 1e-2 for e in errs.values())
            ok &= good
            log(f"check {path:6s} B={b} N={n} window={window}: "
                + " ".join(f"{a}={e:.2e}" for a, e in errs.items()) + (" OK" if good else " FAIL"))
    return ok


# ---------------------------------------------------------------- sweep of our kernel variants

# (block_m, block_n, num_warps, num_stages, pack, tma, atomic_dq); dkdv/dq variants are timed as the
# whole backward with the other kernel at its default.
SWEEP = {
    ("fwd", "full"): [(128, 128, 4, 3), (128, 128, 4, 3, False, True), (128, 128, 4, 4, False, True),
                      (128, 64, 4, 4, False, True), (128, 128, 4, 2, False, True), (128, 128, 8, 3, False, True)],
    ("fwd", "window"): [(64, 32, 4, 3, True), (64, 32, 4, 3, True, True), (128, 32, 4, 3, True, True)],
    ("dkdv", "full"): [(64, 64, 4, 3), (64, 64, 4, 3, False, True), (64, 64, 4, 4, False, True),
                       (64, 128, 8, 3, False, True), (64, 64, 4, 3, False, True, True),
                       (64, 128, 8, 3, False, True, True), (128, 128, 8, 3, False, True, True),
                       (64, 64, 4, 3, False, False, True)],
    ("dkdv", "window"): [(64, 64, 4, 3, True), (64, 64, 4, 3, True, False, True), (128, 128, 8, 3, True, False, True)],
    ("dq", "full"): [(64, 64, 4, 3), (64, 64, 4, 3, False, True), (128, 64, 8, 3, False, True),
                     (64, 128, 4, 3, False, True)],
    ("dq", "window"): [(64, 32, 4, 3, True), (128, 32, 4, 3, True)],
}


def sweep(deadline, cases=("full", "window")):
    """Time each variant at B=1, N=16384 after checking it at N=1000 against the reference; returns
    the fastest config per kernel and case (dkdv/dq: the fastest whole backward)."""
    from agentrl.kernels.sink_attention import CONFIG_OVERRIDES, KernelConfig, _launch_bwd, _Layout

    results, best = [], {}
    for case, window in (("full", None), ("window", WINDOW)):
        if case not in cases:
            continue

        def key(kind, case=case):
            return f"{kind}/{case}/d{D}"

        qc, kc, vc, sc = _inputs(1, 1000, seed=5)
        ref_leaves = [t.detach().clone().requires_grad_() for t in (qc, kc, vc, sc)]
        ref_out = sink_attention_reference(*ref_leaves, window=window)
        gc = torch.randn(ref_out.shape, device="cuda", dtype=torch.float64)
        ref_g = torch.autograd.grad((ref_out * gc).sum(), ref_leaves)
        n = 16384
        q, k, v, s = _inputs(1, n, requires_grad=False)
        out, lse = sink_attention(q, k, v, s, window=window, return_lse=True, backend="triton")
        do = torch.randn_like(out)
        lay = _Layout(False, 1, n, n, HQ, HKV, D)
        bwd_args = (do, q, k, v, s, out, lse, None, None, None, lay, True, window, 1 / math.sqrt(D))

        def run_fwd(q=q, k=k, v=v, s=s, window=window):
            return sink_attention(q, k, v, s, window=window, backend="triton")

        def run_bwd(bwd_args=bwd_args):
            return _launch_bwd(*bwd_args)

        timed = {}
        for kind in ("fwd", "dkdv", "dq"):
            for cfg in SWEEP[(kind, case)]:
                if time.time() > deadline:
                    log(f"sweep: out of time before {kind} {case} {cfg}")
                    break
                CONFIG_OVERRIDES[key(kind)] = KernelConfig(*cfg)
                t0 = time.time()
                try:
                    leaves = [t.detach().clone().requires_grad_() for t in (qc, kc, vc, sc)]
                    o = sink_attention(*leaves, window=window, backend="triton")
                    gr = torch.autograd.grad((o.double() * gc).sum(), leaves)
                    errs = [_rel(o, ref_out)] + [_rel(a, r) for a, r in zip(gr, ref_g, strict=True)]
                    if not max(errs) <= 1e-2:
                        raise AssertionError(f"wrong: rel errors out,dq,dk,dv,dsink {[f'{e:.1e}' for e in errs]}")
                    if kind == "fwd":
                        ms = _do_bench(run_fwd, rep=100)
                    else:
                        ms = _do_bench(run_bwd, rep=100)
                except Exception as exc:  # a variant can fail to compile (shared memory, registers)
                    ms = float("nan")
                    log(f"sweep {kind} {case} {cfg}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
                timed[(kind, cfg)] = ms
                results.append({"kind": kind, "case": case, "cfg": list(cfg), "ms": ms})
                log(f"sweep {kind:4s} {case:6s} {str(cfg):42s} {ms:8.3f} ms{'' if kind == 'fwd' else ' (whole bwd)'}"
                    f"  ({time.time() - t0:.1f}s)")
            CONFIG_OVERRIDES[key(kind)] = None
        # fastest forward; fastest backward: an atomic-dQ dkdv alone, or the best two-kernel pair
        fwd = [(ms, cfg) for (kd, cfg), ms in timed.items() if kd == "fwd" and ms == ms]
        if fwd:
            best[key("fwd")] = list(min(fwd)[1])
        atomic = [(ms, cfg) for (kd, cfg), ms in timed.items() if kd == "dkdv" and ms == ms and len(cfg) > 6 and cfg[6]]
        plain = [(ms, cfg) for (kd, cfg), ms in timed.items() if kd == "dkdv" and ms == ms and not (len(cfg) > 6 and cfg[6])]
        dqs = [(ms, cfg) for (kd, cfg), ms in timed.items() if kd == "dq" and ms == ms]
        pair_ms = float("inf")
        if plain and dqs:
            CONFIG_OVERRIDES[key("dkdv")] = KernelConfig(*min(plain)[1])
            CONFIG_OVERRIDES[key("dq")] = KernelConfig(*min(dqs)[1])
            pair_ms = _do_bench(run_bwd, rep=100)
            log(f"sweep bwd {case} pair dkdv={min(plain)[1]} dq={min(dqs)[1]}: {pair_ms:.3f} ms")
            CONFIG_OVERRIDES[key("dkdv")] = CONFIG_OVERRIDES[key("dq")] = None
        if atomic and min(atomic)[0] < pair_ms:
            best[key("dkdv")] = list(min(atomic)[1])
        elif plain and dqs:
            best[key("dkdv")] = list(min(plain)[1])
            best[key("dq")] = list(min(dqs)[1])
    return results, best


# ---------------------------------------------------------------- main


def main():
    global _LOG
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--paths", default="triton,fa4,auto", help="comma-separated: triton,fa4,auto,flex")
    ap.add_argument("--flex", action="store_true", help="add FlexAttention (compiles for a while)")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-seconds", type=float, default=200)
    ap.add_argument("--sweep-out", default=None, help="write the fastest configs (JSON) here")
    ap.add_argument("--sweep-cases", default="full,window", help="masks to sweep: full,window")
    ap.add_argument("--configs", default=None, help="kernel configs JSON to use (e.g. from --sweep-out)")
    ap.add_argument("--table", action="store_true", help="also windows 512 and 2048 (dispatch table)")
    ap.add_argument("--no-mix", action="store_true", help="skip the GPT-OSS layer mix")
    ap.add_argument("--no-cases", action="store_true", help="skip the single-layer cases (mix only)")
    ap.add_argument("--out", default=None, help="directory for bench_log.txt and bench.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sink_attention_bench needs a CUDA GPU")
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        _LOG = open(out_dir / "bench_log.txt", "a")
    import triton

    from agentrl.kernels import _fa4
    from agentrl.kernels.sink_attention import load_config_overrides

    paths = [p for p in args.paths.split(",") if p]
    if args.flex and "flex" not in paths:
        paths.append("flex")
    fa4_reason = _fa4.unsupported_reason(torch.empty(1, device="cuda", dtype=DTYPE), D, None, True, None)
    if fa4_reason is not None and "fa4" in paths:
        log(f"FA4 unavailable, skipped: {fa4_reason}")
        paths.remove("fa4")
    log(f"device={torch.cuda.get_device_name()} torch={torch.__version__} triton={triton.__version__} "
        f"paths={paths} argv={sys.argv[1:]}")
    t0 = time.time()
    if args.sweep:
        results, best = sweep(time.time() + args.sweep_seconds, args.sweep_cases.split(","))
        log(f"sweep best: {json.dumps(best)} ({time.time() - t0:.0f}s)")
        if args.sweep_out:
            Path(args.sweep_out).write_text(json.dumps(best, indent=1))
        from agentrl.kernels.sink_attention import CONFIG_OVERRIDES, KernelConfig

        CONFIG_OVERRIDES.update({k: KernelConfig(*v) for k, v in best.items()})  # measure with the winners
        if out_dir:
            (out_dir / "sweep.json").write_text(json.dumps({"results": results, "best": best}, indent=1))
    if args.configs:
        log(f"configs: {load_config_overrides(args.configs)}")
    if args.check:
        t1 = time.time()
        log(f"check: {'ALL OK' if check(paths) else 'FAILURES'} ({time.time() - t1:.0f}s)")

    rows = []
    windows = [None, WINDOW] + ([512, 2048] if args.table else [])
    for b, n in [] if args.no_cases else CASES:
        for window in windows:
            case = "full" if window is None else f"win{window}"
            for path in paths:
                t1 = time.time()
                try:
                    r = measure(path_fn(path, window, b, n), b, n)
                except Exception as exc:
                    r = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                torch.cuda.empty_cache()
                r.update(path=path, case=case, b=b, n=n)
                rows.append(r)
                log(f"{path:6s} {case:8s} B={b} N={n:5d} "
                    + " ".join(f"{a}={x:.3f}" if isinstance(x, float) else f"{a}={x}" for a, x in r.items()
                               if a not in ("path", "case", "b", "n")) + f" ({time.time() - t1:.0f}s)")
    if not args.no_mix:
        for b, n in CASES:
            for path in paths:
                t1 = time.time()
                try:
                    ms = measure_mix(path, b, n)
                    r = {"fwdbwd_ms": ms}
                except Exception as exc:
                    r = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                r.update(path=path, case="gptoss_mix", b=b, n=n)
                rows.append(r)
                log(f"{path:6s} mix24    B={b} N={n:5d} {r} ({time.time() - t1:.0f}s)")
    if out_dir:
        (out_dir / "bench.json").write_text(json.dumps(rows, indent=1))

    def get(path, case, b, n, key):
        for r in rows:
            if (r["path"], r["case"], r["b"], r["n"]) == (path, case, b, n) and key in r:
                return r[key]
        return float("nan")

    log("")
    log(f"{'case':10s} {'B x N':>9s} {'mode':7s} " + " ".join(f"{p:>9s}" for p in paths)
        + ("   fa4/triton  fa4/auto" if "fa4" in paths else ""))
    for b, n in CASES:
        for case in [("full" if w is None else f"win{w}") for w in windows] + ["gptoss_mix"]:
            for key in ("fwd_ms", "fwdbwd_ms"):
                vals = [get(p, case, b, n, key) for p in paths]
                if all(v != v for v in vals):
                    continue
                line = f"{case:10s} {f'{b}x{n}':>9s} {key[:-3]:7s} " + " ".join(f"{v:9.3f}" for v in vals)
                if "fa4" in paths:
                    fa = get("fa4", case, b, n, key)
                    line += f"   {fa / get('triton', case, b, n, key):10.2f} {fa / get('auto', case, b, n, key):9.2f}"
                log(line)
    if "fa4" in paths:
        def r(path, case, key, b=1, n=16384):
            return get("fa4", case, b, n, key) / get(path, case, b, n, key)
        mix = statistics.mean([r("auto", "gptoss_mix", "fwdbwd_ms", b, n) for b, n in CASES])
        log(f"(auto_gptoss_mix_fwdbwd = mean over B=1,N=16384 and B=4,N=4096 of FA4-only / auto; "
            f"{r('auto', 'gptoss_mix', 'fwdbwd_ms'):.2f} and {r('auto', 'gptoss_mix', 'fwdbwd_ms', 4, 4096):.2f})")
        log(f"sink_attn_vs_fa4: auto_full16k_fwd={r('auto', 'full', 'fwd_ms'):.2f} "
            f"auto_full16k_fwdbwd={r('auto', 'full', 'fwdbwd_ms'):.2f} "
            f"auto_win16k_fwd={r('auto', f'win{WINDOW}', 'fwd_ms'):.2f} "
            f"auto_win16k_fwdbwd={r('auto', f'win{WINDOW}', 'fwdbwd_ms'):.2f} "
            f"auto_gptoss_mix_fwdbwd={mix:.2f} "
            f"triton_full16k_fwd={r('triton', 'full', 'fwd_ms'):.2f} "
            f"triton_full16k_fwdbwd={r('triton', 'full', 'fwdbwd_ms'):.2f}")
    elif "flex" in paths and "triton" in paths:
        def rf(case, key):
            return get("flex", case, 1, 16384, key) / get("triton", case, 1, 16384, key)
        log(f"sink_attn_vs_flex: full16k_fwd={rf('full', 'fwd_ms'):.2f} full16k_fwdbwd={rf('full', 'fwdbwd_ms'):.2f} "
            f"win16k_fwd={rf(f'win{WINDOW}', 'fwd_ms'):.2f} win16k_fwdbwd={rf(f'win{WINDOW}', 'fwdbwd_ms'):.2f} "
            f"gptoss_mix16k_fwdbwd={rf('gptoss_mix', 'fwdbwd_ms'):.2f}")


if __name__ == "__main__":
    main()
