"""Peak memory of token log-probs (forward + backward): naive full logits vs chunked_logprobs.

naive:   logits = hidden @ W.T ([N, V] fp32), log_softmax, gather, backward through autograd.
chunked: agentrl.train.logprobs.chunked_logprobs (no [N, V] tensor; custom backward).
Both compute d(sum of log-probs)/d(hidden, W) in fp32; the outputs (log-probs, both gradients) are compared.

What "peak" measures:
  cuda: torch.cuda.max_memory_allocated() during the variant minus the memory allocated before it (inputs
        excluded): the tensors the computation needs on top of its inputs.
  cpu:  each variant runs in a fresh subprocess; peak = the process's RSS high-water mark (ru_maxrss) minus
        its RSS just before the variant (after imports and inputs): the extra resident memory it needed.
Run: python benchmarks/logprob_memory.py --device cuda            (8 x 2048 tokens, vocab 201,088)
     python benchmarks/logprob_memory.py --device cpu --batch 1 --seq 1024 --chunk 64
The last line is: logprob: naive_peak_mb=<n> chunked_peak_mb=<n> ratio=<n> max_abs_diff=<n>
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

import torch

from agentrl.train.logprobs import chunked_logprobs


def _inputs(args, device):
    g = torch.Generator().manual_seed(0)
    n = args.batch * args.seq
    hidden = torch.randn(n, args.hidden, generator=g).to(device)
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * args.init_std).to(device)
    labels = torch.randint(0, args.vocab, (n,), generator=g).to(device)
    return hidden.requires_grad_(True), weight.requires_grad_(True), labels


def _run(variant, hidden, weight, labels, chunk):
    if variant == "naive":
        logp = torch.log_softmax(hidden @ weight.t(), dim=-1).gather(1, labels[:, None]).squeeze(1)
    else:
        logp, _ = chunked_logprobs(hidden, weight, labels, chunk_size=chunk, compute_entropy=False)
    logp.sum().backward()
    return logp.detach()


def _rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _child(args):
    """Run one variant on CPU in this fresh process; print peak MB and save outputs for comparison."""
    torch.set_num_threads(args.threads)
    hidden, weight, labels = _inputs(args, "cpu")
    before = _rss_mb()
    logp = _run(args.variant, hidden, weight, labels, args.chunk)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
    torch.save({"logp": logp, "gh": hidden.grad, "gw": weight.grad}, args.out)
    print(json.dumps({"peak_mb": peak}))


def _cpu(args):
    peaks, outs = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("naive", "chunked"):
            out = os.path.join(tmp, f"{variant}.pt")
            cmd = [sys.executable, __file__, "--child", "--variant", variant, "--out", out] + _common(args)
            res = subprocess.run(cmd, capture_output=True, text=True, check=True)
            peaks[variant] = json.loads(res.stdout.strip().splitlines()[-1])["peak_mb"]
            outs[variant] = torch.load(out)
    return peaks, outs


def _cuda(args):
    peaks, outs = {}, {}
    for variant in ("naive", "chunked"):
        hidden, weight, labels = _inputs(args, "cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        logp = _run(variant, hidden, weight, labels, args.chunk)
        torch.cuda.synchronize()
        peaks[variant] = (torch.cuda.max_memory_allocated() - before) / 2**20
        outs[variant] = {"logp": logp.cpu(), "gh": hidden.grad.cpu(), "gw": weight.grad.cpu()}
        del hidden, weight, labels, logp
        torch.cuda.empty_cache()
    return peaks, outs


def _common(args):
    return [
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--vocab",
        str(args.vocab),
        "--hidden",
        str(args.hidden),
        "--chunk",
        str(args.chunk),
        "--threads",
        str(args.threads),
        "--init-std",
        str(args.init_std),
    ]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"]
    )
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=201088)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--chunk", type=int, default=1024, help="tokens per chunk")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--init-std",
        dest="init_std",
        type=float,
        default=0.02,
        help="std of the random LM head (0.02 = transformers' initializer_range); hidden ~ N(0, 1)",
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return _child(args)
    peaks, outs = (_cuda if args.device == "cuda" else _cpu)(args)
    diffs = {k: (outs["naive"][k] - outs["chunked"][k]).abs().max().item() for k in ("logp", "gh", "gw")}
    scale = {k: outs["naive"][k].abs().max().item() for k in diffs}
    n = args.batch * args.seq
    print(
        f"device={args.device} tokens={args.batch}x{args.seq}={n} vocab={args.vocab} hidden={args.hidden} "
        f"chunk={args.chunk} init_std={args.init_std} fp32 fwd+bwd; [N,V] fp32 logits alone = {n * args.vocab * 4 / 2**20:.0f} MB"
    )
    print(
        "max_abs_diff per output (logp, grad hidden, grad W): "
        + " ".join(f"{k}={v:.2e}" for k, v in diffs.items())
    )
    print("max |naive| per output: " + " ".join(f"{k}={v:.3g}" for k, v in scale.items()))
    ratio = peaks["naive"] / peaks["chunked"]
    print(
        f"logprob: naive_peak_mb={peaks['naive']:.0f} chunked_peak_mb={peaks['chunked']:.0f} "
        f"ratio={ratio:.1f} max_abs_diff={max(diffs.values()):.2e}"
    )


if __name__ == "__main__":
    main()
