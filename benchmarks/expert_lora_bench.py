"""PEFT's expert LoRA wrapper against agentrl's unmerged grouped forward (``agentrl/models/expert_lora.py``) on one
GPT-OSS-20B-shaped MoE layer (issue 31 scope 1): forward + backward time and peak memory.

The layer is transformers' ``GptOssMLP`` (router + fused experts, transformers' default ``grouped_mm`` experts
forward) with random weights, LoRA on ``experts.gate_up_proj`` and ``experts.down_proj`` through
:func:`agentrl.models.lora.apply_lora` (the adapters made non-zero). ``peft`` runs PEFT's ``ParamWrapper`` forward
(it folds ``W + s B A`` into a new expert stack on every call), ``ours`` the unmerged grouped forward. A step is
the forward of ``--tokens`` hidden states (which require grad, as in training) and the backward of a fixed random
projection of the output; the time is the median of ``--repeats`` steps after one warm-up. Each variant runs in its
own process, so its peak is its own: on the CPU the peak resident set (``ru_maxrss``) above the resident set after
setup, on CUDA ``max_memory_allocated`` above the allocation after setup. The variants' outputs and adapter
gradients are compared (largest difference over the largest magnitude, per tensor).

    python benchmarks/expert_lora_bench.py                           # CPU, float32, 256 tokens, 32 experts
    python benchmarks/expert_lora_bench.py --device cuda --tokens 8192   # bfloat16 on CUDA

Prints each variant's line, then the summary line last:
``expert_lora: device=<> dtype=<> tokens=<> experts=<> top_k=<> hidden=<> inter=<> rank=<> peft_ms=<>
ours_ms=<> speedup=<peft/ours> peft_peak_mb=<> ours_peak_mb=<> max_rel_diff=<>``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def build(args: argparse.Namespace) -> torch.nn.Module:
    """The MoE layer with LoRA (ours installed), on ``args.device`` in ``args.dtype``, from ``args.seed``."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from agentrl.models.lora import LoraSpec, adapter_parameters, apply_lora

    config = GptOssConfig(hidden_size=args.hidden, intermediate_size=args.inter, num_local_experts=args.experts,
                          num_experts_per_tok=args.top_k)
    config._experts_implementation = "grouped_mm"  # what transformers picks for a loaded model
    dtype = getattr(torch, args.dtype)
    torch.set_default_dtype(dtype)
    with torch.device(args.device):
        layer = torch.nn.Module()
        layer.mlp = GptOssMLP(config)
    torch.set_default_dtype(torch.float32)
    g = torch.Generator(args.device).manual_seed(args.seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.normal_(0.0, 0.02 if "bias" not in name else 0.01, generator=g)
    apply_lora(layer, LoraSpec(rank=args.rank, target_modules=["experts.gate_up_proj", "experts.down_proj"]),
               seed=args.seed)
    with torch.no_grad():
        for _, p in adapter_parameters(layer):
            p.normal_(0.0, 0.02, generator=g)
    return layer


def run_variant(args: argparse.Namespace) -> None:
    """One variant in this process: prints its JSON line; saves its output and adapter gradients to ``args.save``."""
    from agentrl.models import expert_lora
    from agentrl.models.lora import adapter_parameters

    layer = build(args)
    if args.impl == "peft":
        expert_lora.remove(layer)
    cuda = args.device == "cuda"
    g = torch.Generator(args.device).manual_seed(args.seed + 1)
    dtype = getattr(torch, args.dtype)
    x = torch.randn(1, args.tokens, args.hidden, generator=g, device=args.device, dtype=dtype).requires_grad_(True)
    probe = torch.randn(1, args.tokens, args.hidden, generator=g, device=args.device, dtype=dtype)

    def step() -> torch.Tensor:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out = layer.mlp(x)[0]
        (out.float() * probe.float()).sum().backward()
        return out.detach()

    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _rss_mb()
    times = []
    for i in range(args.repeats + 1):
        t0 = time.perf_counter()
        out = step()
        if cuda:
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    if cuda:
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    grads = {n: p.grad.detach().cpu() for n, p in adapter_parameters(layer)}
    torch.save({"out": out.cpu(), "x_grad": x.grad.cpu(), **grads}, args.save)
    print(json.dumps({"impl": args.impl, "ms": 1e3 * statistics.median(times),
                      "times_ms": [round(1e3 * t, 1) for t in times], "peak_mb": peak}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, help="float32 (the CPU default) or bfloat16 (the CUDA default)")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2880)
    p.add_argument("--inter", type=int, default=2880)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--impl", choices=["peft", "ours"], help=argparse.SUPPRESS)
    p.add_argument("--save", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.impl:
        run_variant(args)
        return
    results, saved = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for impl in ("peft", "ours"):
            path = os.path.join(tmp, f"{impl}.pt")
            argv = [a for a in sys.argv[1:]] + ["--impl", impl, "--save", path, "--dtype", args.dtype]
            proc = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"{impl} failed:\n{proc.stdout}{proc.stderr}")
            line = proc.stdout.strip().splitlines()[-1]
            print(line, flush=True)
            results[impl] = json.loads(line)
            saved[impl] = torch.load(path)
    diff = max(float((saved["ours"][k].double() - v.double()).abs().max() / v.double().abs().max().clamp_min(1e-30))
               for k, v in saved["peft"].items())
    peft, ours = results["peft"], results["ours"]
    print(f"expert_lora: device={args.device} dtype={args.dtype} tokens={args.tokens} experts={args.experts} "
          f"top_k={args.top_k} hidden={args.hidden} inter={args.inter} rank={args.rank} peft_ms={peft['ms']:.0f} "
          f"ours_ms={ours['ms']:.0f} speedup={peft['ms'] / ours['ms']:.2f} peft_peak_mb={peft['peak_mb']:.0f} "
          f"ours_peak_mb={ours['peak_mb']:.0f} max_rel_diff={diff:.1e}")


if __name__ == "__main__":
    main()
