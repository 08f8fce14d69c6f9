"""Rollout decode throughput: agentrl's decode engine against transformers' ``generate`` (issue 20).

In one process, on one device, for each model and batch size it samples ``B`` completions of ``--new-tokens``
tokens (temperature 1, no top-k/top-p, no stop ids, so every row runs to the limit) from prompts of 200-300
random tokens, and reports generated tokens per second (prefill included) for:

- ``ours``: :class:`agentrl.engines.decode_engine.DecodeEngine` (``generate_sync``; a first call on other
  prompts compiles the Triton kernels, then the cache is released and the second call, which allocates
  its cache and captures its CUDA graphs again, is timed);
- ``dynamic``: ``model.generate`` with transformers' dynamic cache (left-padded batch);
- ``compiled``: ``model.generate(cache_implementation="static")``, which transformers compiles with
  ``torch.compile`` (CUDA graphs); the first call compiles and is not timed;
- ``ours_lora`` (only when ``--paths`` names it): ``ours`` after :func:`agentrl.models.lora.apply_lora` with
  rank ``--lora-rank`` on the default targets (GPT-OSS: attention and both fused expert tensors; Llama: attention
  and MLP projections) and random non-zero adapters: the engine's unmerged LoRA path. It runs after the model's
  other paths (the adapter is injected in place).

Models (random weights, bf16 on a GPU): ``smollm``, a ``LlamaForCausalLM`` with SmolLM2-135M-Instruct's
shape; ``gptoss``, the GPT-OSS architecture of ``examples/train_gpu_tiny_gpt_oss.sh`` (4 layers, hidden
256, 8 experts top-2, sliding-window/full alternation, sinks, the 201,088-token vocabulary).

``retool_gen_share`` is read from the metrics of a GPU retool run (``examples/train_gpu_retool.sh``): the mean
over RL steps of ``timing_s/gen / timing_s/step`` (``--retool-metrics RUN_DIR/metrics.jsonl``; ``nan``
without one). ``--from-json`` prints the summary of an earlier run's ``--json-out`` file (with the retool
figure added) without measuring.

    python benchmarks/rollout_bench.py [--json-out r.json] [--retool-metrics RUN/metrics.jsonl]
    python benchmarks/rollout_bench.py --device cpu --dtype float32 --smollm-layers 2 --batches 2 --new-tokens 8

Prints one line per measurement, then last:
``rollout_vs_hf: smollm_b64=<ours/compiled> smollm_b256=<..> gptoss_b64=<..> gptoss_b256=<..>
smollm_b256_tok_s=<ours> retool_gen_share=<x>``; with ``ours_lora`` runs, before it:
``lora_decode: <model>_b<B>=<ours tok/s> <model>_b<B>_lora=<ours_lora tok/s> <model>_b<B>_ratio=<lora/plain> ...``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

PATHS = ("ours", "dynamic", "compiled")
LORA_PATH = "ours_lora"


def build_model(name: str, device: str, dtype, layers: int | None):
    import torch
    import transformers

    if name == "smollm":
        cfg = transformers.LlamaConfig(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers or 30,
            num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
            rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype)
        model.config._attn_implementation = "sdpa"
        return model.eval()
    from agentrl.models.tiny import tiny_gpt_oss

    return tiny_gpt_oss(num_layers=layers or 4, hidden=256, experts=8, top_k=2, heads=8, kv_heads=2,
                        dtype=dtype, device=device, seed=0)


def prompts_for(batch: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(rng.randint(200, 300))] for _ in range(batch)]


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def run_ours(model, prompts, new_tokens: int, device: str, warmup_prompts) -> tuple[float, int]:
    from agentrl.engines.base import SamplingParams
    from agentrl.engines.decode_engine import DecodeEngine

    engine = DecodeEngine(model, max_batch_size=len(prompts), seed=0)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
    # warm-up on other prompts (nothing cached to reuse): graph capture, Triton compilation
    engine.generate_sync(warmup_prompts, SamplingParams(max_new_tokens=min(new_tokens, 32), temperature=1.0))
    engine.release()  # the timed call starts from an empty cache (it captures its graphs again, timed)
    engine.reseed(1)
    _sync(device)
    t0 = time.perf_counter()
    out = engine.generate_sync(prompts, params)
    _sync(device)
    elapsed = time.perf_counter() - t0
    engine.release()
    return elapsed, sum(len(c.token_ids) for c in out)


def add_lora(model, rank: int) -> None:
    """Inject a rank-``rank`` adapter on the default targets, with random non-zero factors."""
    import torch

    from agentrl.models.lora import LoraSpec, apply_lora

    apply_lora(model, LoraSpec(rank=rank), seed=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


def run_hf(model, prompts, new_tokens: int, device: str, static: bool) -> tuple[float, int]:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    kwargs = dict(attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    if static:
        kwargs["cache_implementation"] = "static"
    with torch.no_grad():
        # warm-up: compiles with a static cache (same shapes as the timed call), a short run otherwise
        model.generate(ids, **(kwargs if static else dict(kwargs, max_new_tokens=16, min_new_tokens=16)))
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, **kwargs)
        _sync(device)
    elapsed = time.perf_counter() - t0
    return elapsed, int((out.shape[1] - width) * out.shape[0])


def measure(args) -> dict:
    import torch

    dtype = getattr(torch, args.dtype)
    results: dict = {"device": args.device, "dtype": args.dtype, "new_tokens": args.new_tokens, "runs": {}}
    if args.device == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
    results["torch"] = torch.__version__
    import transformers

    results["transformers"] = transformers.__version__
    for name in args.models:
        model = build_model(name, args.device, dtype, args.smollm_layers if name == "smollm" else args.gptoss_layers)
        plain = [p for p in args.paths if p != LORA_PATH]
        lora = [LORA_PATH] if LORA_PATH in args.paths else []
        order = [(path, batch) for group in (plain, lora) for batch in args.batches for path in group]
        for path, batch in order:
            prompts = prompts_for(batch, model.config.vocab_size, seed=batch)
            if path == LORA_PATH and not hasattr(model, "peft_config"):
                add_lora(model, args.lora_rank)
            t0 = time.perf_counter()
            try:
                if path in ("ours", LORA_PATH):
                    warmup = prompts_for(batch, model.config.vocab_size, seed=batch + 10_000)
                    elapsed, tokens = run_ours(model, prompts, args.new_tokens, args.device, warmup)
                else:
                    elapsed, tokens = run_hf(model, prompts, args.new_tokens, args.device,
                                             static=path == "compiled")
            except Exception as exc:  # noqa: BLE001 - one failing path must not lose the others
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
                results["runs"][f"{name}_b{batch}_{path}"] = {"error": error}
                print(f"{name} B={batch} {path}: FAILED {error}", flush=True)
                continue
            tok_s = tokens / elapsed
            results["runs"][f"{name}_b{batch}_{path}"] = {"tok_s": tok_s, "timed_s": elapsed, "tokens": tokens,
                                                          "wall_s_with_warmup": time.perf_counter() - t0}
            print(f"{name} B={batch} {path}: {tok_s:,.0f} tokens/s ({tokens} tokens in {elapsed:.2f} s; "
                  f"{time.perf_counter() - t0:.1f} s with warm-up)", flush=True)
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return results


def retool_gen_share(path: str | None) -> float:
    """Mean over RL steps (step >= 1) of ``timing_s/gen / timing_s/step`` in a trainer's metrics.jsonl."""
    if not path:
        return float("nan")
    shares = []
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        if rec.get("step", 0) >= 1 and rec.get("timing_s/step") and "timing_s/gen" in rec:
            shares.append(rec["timing_s/gen"] / rec["timing_s/step"])
    return sum(shares) / len(shares) if shares else float("nan")


def summary(results: dict, share: float) -> str:
    runs = results["runs"]

    def tok_s(key: str) -> float:
        return runs.get(key, {}).get("tok_s", float("nan"))

    def ratio(key: str) -> float:
        return tok_s(f"{key}_ours") / tok_s(f"{key}_compiled")

    ours256 = tok_s("smollm_b256_ours")
    lora_keys = sorted(k[: -len("_ours_lora")] for k in runs if k.endswith("_ours_lora"))
    lora_line = "lora_decode: " + " ".join(
        f"{k}={tok_s(k + '_ours'):.0f} {k}_lora={tok_s(k + '_ours_lora'):.0f} "
        f"{k}_ratio={tok_s(k + '_ours_lora') / tok_s(k + '_ours'):.3f}" for k in lora_keys) + "\n" if lora_keys else ""
    fmt = lambda x: "nan" if math.isnan(x) else f"{x:.2f}"  # noqa: E731
    return lora_line + (f"rollout_vs_hf: smollm_b64={fmt(ratio('smollm_b64'))} smollm_b256={fmt(ratio('smollm_b256'))} "
            f"gptoss_b64={fmt(ratio('gptoss_b64'))} gptoss_b256={fmt(ratio('gptoss_b256'))} "
            f"smollm_b256_tok_s={'nan' if math.isnan(ours256) else f'{ours256:.0f}'} retool_gen_share={fmt(share)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--models", default="smollm,gptoss", type=lambda s: s.split(","))
    parser.add_argument("--batches", default="64,256", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--paths", default=",".join(PATHS), type=lambda s: s.split(","),
                        help=f"of {', '.join(PATHS + (LORA_PATH,))}")
    parser.add_argument("--lora-rank", type=int, default=16, help="the adapter rank of the ours_lora path")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--smollm-layers", type=int, default=None, help="fewer layers for a quick check")
    parser.add_argument("--gptoss-layers", type=int, default=None)
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--from-json", default=None, help="print the summary of an earlier --json-out")
    parser.add_argument("--retool-metrics", default=None, help="metrics.jsonl of a GPU retool run")
    args = parser.parse_args(argv)
    bad = [p for p in args.paths if p not in PATHS + (LORA_PATH,)]
    if bad:
        parser.error(f"unknown paths {bad}; choose from {PATHS + (LORA_PATH,)}")
    results = json.loads(Path(args.from_json).read_text()) if args.from_json else measure(args)
    if args.json_out and not args.from_json:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    print(summary(results, retool_gen_share(args.retool_metrics)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
