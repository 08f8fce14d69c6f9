"""Rollout decode throughput: agentrl's decode engine against transformers' ``generate`` (issue 20).

In one process, on one device, for each model and batch size it samples ``B`` completions of ``--new-tokens``
tokens (temperature 1, no top-k/top-p, no stop ids, so every row runs to the limit) from prompts of 200-300
random tokens, and reports generated tokens per second (prefill included) for:

- ``ours``: :class:`agentrl.engines.decode.decode_engine.DecodeEngine` (``generate_sync``; a first call on other
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
256, 8 experts top-2, sliding-window/full alternation, sinks, the 201,088-token vocabulary); ``gptoss20b``
(issue 31, not in the default ``--models``), GPT-OSS-20B's full shape (20.9B parameters) with random bf16
weights, built on the GPU through the meta device as ``model=gpt-oss-20b-random`` builds it
(:func:`agentrl.models.gpt_oss_20b.random_init_model`). It runs the paths of ``--big-paths`` (default
``ours,ours_lora``: transformers' baselines at 20B take long; name them there to run them).

**The physical limit** (:mod:`decode_limit`): before the first model, a large device-to-device copy measures
the bandwidth; every row prints, next to its figures, the bytes one decode step reads (weights, experts
touched, the KV cache our kernel reads, the adapter) and ``limit = B / (bytes / bandwidth)``. ``ours`` rows
also report ``decode_tok_s``: tokens of the decode chunks after the first (which captures the CUDA graph)
over their time, prefill excluded, the figure the limit bounds. On a GPU a row whose slot cache (the size the
engine will allocate, :func:`decode_limit.planned_cache_bytes`) plus ``--headroom-gb`` does not fit in the
free memory is skipped with its reason. ``--json-out`` is rewritten after every row, so a run cut short
keeps what it measured.

Prompts are random tokens, ``--prompt-tokens`` long (``LO-HI``: uniform lengths; ``N``: all ``N``; default
200-300; 2048 is a retool context).

``retool_gen_share`` is read from the metrics of a GPU retool run (``examples/train_gpu_retool.sh``): the mean
over RL steps of ``timing_s/gen / timing_s/step`` (``--retool-metrics RUN_DIR/metrics.jsonl``; ``nan``
without one). ``--from-json`` prints the summary of an earlier run's ``--json-out`` file (with the retool
figure added) without measuring.

    python benchmarks/rollout_bench.py [--json-out r.json] [--retool-metrics RUN/metrics.jsonl]
    python benchmarks/rollout_bench.py --device cpu --dtype float32 --smollm-layers 2 --batches 2 --new-tokens 8

    python benchmarks/rollout_bench.py --models gptoss20b --batches 8,64,256 --prompt-tokens 2048 \
        --paths ours,ours_lora --lora-rank 16 --json-out r20b.json

Prints one line per measurement, then:
``rollout_vs_hf: smollm_b64=<ours/compiled> smollm_b256=<..> gptoss_b64=<..> gptoss_b256=<..>
smollm_b256_tok_s=<ours> retool_gen_share=<x>``; with ``ours_lora`` runs, before it:
``lora_decode: <model>_b<B>=<ours tok/s> <model>_b<B>_lora=<ours_lora tok/s> <model>_b<B>_ratio=<lora/plain> ...``.
With ``gptoss20b`` runs (only those: the ``rollout_vs_hf`` line is left out), the last line is
``rollout_20b: b8=<tok/s> b64=<> b256=<> b64_lora=<> b256_lora=<> limit_b64=<> limit_b256=<>``: decode
tokens/s (``decode_tok_s``) of ``ours`` and ``ours_lora``, and the limit of the ``ours`` rows.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

from decode_limit import (  # this directory is on sys.path
    copy_bandwidth,
    planned_cache_bytes,
    step_bytes,
    tok_s_limit,
)

PATHS = ("ours", "dynamic", "compiled")
LORA_PATH = "ours_lora"
BIG = "gptoss20b"


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
    if name == BIG:
        from agentrl.models.gpt_oss_20b import gpt_oss_20b_config, random_init_model

        config = gpt_oss_20b_config(**({"num_hidden_layers": layers} if layers else {}))
        if str(device) == "meta":  # shapes only (tests, byte counts): no memory, no init
            from transformers import GptOssForCausalLM

            with torch.device("meta"):
                return GptOssForCausalLM(config).to(dtype).eval()
        return random_init_model(config, device=device, dtype=dtype, seed=0).eval()
    from agentrl.models.tiny import tiny_gpt_oss

    return tiny_gpt_oss(num_layers=layers or 4, hidden=256, experts=8, top_k=2, heads=8, kv_heads=2,
                        dtype=dtype, device=device, seed=0)


def prompt_range(spec: str) -> tuple[int, int]:
    """``"LO-HI"`` or ``"N"`` -> ``(lo, hi)`` prompt lengths."""
    lo, _, hi = spec.partition("-")
    lo_n, hi_n = int(lo), int(hi or lo)
    if not 1 <= lo_n <= hi_n:
        raise ValueError(f"prompt length range {spec!r}: need 1 <= LO <= HI")
    return lo_n, hi_n


def prompts_for(batch: int, vocab: int, seed: int, lengths: tuple[int, int] = (200, 300)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(rng.randint(*lengths))] for _ in range(batch)]


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


class DecodeClock:
    """Times an engine's decode chunks (``ModelRunner.decode``, which ends by copying the chunk's tokens to the
    host, so its wall time covers the device work) and counts their live tokens."""

    def __init__(self, runner) -> None:
        self.chunks: list[tuple[float, int]] = []
        inner = runner.decode

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            self.chunks.append((time.perf_counter() - t0, sum(sum(row) for row in out.live)))
            return out

        runner.decode = timed

    def steady_tok_s(self) -> float:
        """Tokens per second of the chunks after the first (which captures the CUDA graph); nan without two."""
        rest = self.chunks[1:]
        seconds = sum(t for t, _ in rest)
        return sum(n for _, n in rest) / seconds if rest and seconds > 0 else float("nan")


def run_ours(model, prompts, new_tokens: int, device: str, warmup_prompts) -> tuple[float, int, float]:
    """``(seconds, tokens, decode tokens/s)`` of the timed call (see the module docstring)."""
    from agentrl.engines.base import SamplingParams
    from agentrl.engines.decode.decode_engine import DecodeEngine

    engine = DecodeEngine(model, max_batch_size=len(prompts), seed=0)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
    # warm-up on other prompts (nothing cached to reuse): graph capture, Triton compilation
    engine.generate_sync(warmup_prompts, SamplingParams(max_new_tokens=min(new_tokens, 32), temperature=1.0))
    engine.release()  # the timed call starts from an empty cache (it captures its graphs again, timed)
    engine.reseed(1)
    clock = DecodeClock(engine.runner)
    _sync(device)
    t0 = time.perf_counter()
    out = engine.generate_sync(prompts, params)
    _sync(device)
    elapsed = time.perf_counter() - t0
    engine.release()
    return elapsed, sum(len(c.token_ids) for c in out), clock.steady_tok_s()


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


def save(results: dict, path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(results, indent=2))


def free_gpu_bytes() -> int:
    """Bytes a new allocation can get: free device memory plus what torch's allocator holds unused."""
    import torch

    free, _ = torch.cuda.mem_get_info()
    return int(free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated())


def row_limit(model, batch: int, prompts: list[list[int]], new_tokens: int, bandwidth: float) -> dict:
    """The row's bytes per decode step and tokens/s limits (:mod:`decode_limit`)."""
    parts = step_bytes(model, batch, [len(p) for p in prompts], new_tokens)
    return {"bytes_per_step": parts["total"], "kv_bytes_per_step": parts["kv"], "lora_bytes_per_step": parts["lora"],
            "experts_touched_per_layer": parts["experts_touched"], "engine_bytes_per_step": parts["engine_total"],
            "limit_tok_s": tok_s_limit(batch, parts["total"], bandwidth),
            "engine_limit_tok_s": tok_s_limit(batch, parts["engine_total"], bandwidth)}


def cache_misfit(model, batch: int, prompts: list[list[int]], new_tokens: int, headroom: float) -> str | None:
    """Why the engine's slot cache for this row cannot fit in the free GPU memory, or None."""
    import torch

    need = planned_cache_bytes(model, batch, max(len(p) for p in prompts), new_tokens)
    free = free_gpu_bytes()
    if need + headroom <= free:
        return None
    return (f"slot cache {need / 1e9:.1f} GB + headroom {headroom / 1e9:.1f} GB > {free / 1e9:.1f} GB free "
            f"on {torch.cuda.get_device_name()}")


def limit_text(lim: dict) -> str:
    text = (f"limit {lim['limit_tok_s']:,.0f} tokens/s ({lim['bytes_per_step'] / 1e9:.2f} GB/step: KV "
            f"{lim['kv_bytes_per_step'] / 1e9:.2f} GB, LoRA {lim['lora_bytes_per_step'] / 1e9:.3f} GB, "
            f"{lim['experts_touched_per_layer']:.2f} experts/layer)")
    if lim["engine_bytes_per_step"] > lim["bytes_per_step"] * 1.001:
        text += f"; all experts, as our engine reads: {lim['engine_limit_tok_s']:,.0f} tokens/s"
    return text


def measure(args) -> dict:
    import gc

    import torch

    dtype = getattr(torch, args.dtype)
    results: dict = {"device": args.device, "dtype": args.dtype, "new_tokens": args.new_tokens,
                     "prompt_tokens": list(args.prompt_tokens), "runs": {}}
    if args.device == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
    results["torch"] = torch.__version__
    import transformers

    results["transformers"] = transformers.__version__
    copy_mb = args.copy_mb or (2048 if args.device == "cuda" else 256)
    bandwidth = results["copy_bandwidth_bytes_s"] = copy_bandwidth(args.device, nbytes=copy_mb << 20)
    print(f"copy bandwidth: {bandwidth / 1e12:.3f} TB/s (read + written, {copy_mb} MiB tensor, "
          f"{results.get('gpu', args.device)})", flush=True)
    save(results, args.json_out)
    for name in args.models:
        t0 = time.perf_counter()
        layers = {"smollm": args.smollm_layers, "gptoss": args.gptoss_layers, BIG: args.gptoss20b_layers}[name]
        model = build_model(name, args.device, dtype, layers)
        _sync(args.device)
        n_params = sum(p.numel() for p in model.parameters())
        results.setdefault("models", {})[name] = {"params": n_params, "build_s": time.perf_counter() - t0}
        print(f"{name}: {n_params / 1e9:.3f}B parameters, built in {time.perf_counter() - t0:.1f} s", flush=True)
        paths = args.big_paths if name == BIG else args.paths
        plain = [p for p in paths if p != LORA_PATH]
        lora = [LORA_PATH] if LORA_PATH in paths else []
        order = [(path, batch) for group in (plain, lora) for batch in args.batches for path in group]
        for path, batch in order:
            key = f"{name}_b{batch}_{path}"
            prompts = prompts_for(batch, model.config.vocab_size, seed=batch, lengths=args.prompt_tokens)
            if path == LORA_PATH and not hasattr(model, "peft_config"):
                add_lora(model, args.lora_rank)
            lim = row_limit(model, batch, prompts, args.new_tokens, bandwidth)
            ours = path in ("ours", LORA_PATH)
            misfit = cache_misfit(model, batch, prompts, args.new_tokens, args.headroom_gb * 1e9) \
                if ours and args.device == "cuda" else None
            if misfit:
                results["runs"][key] = {"skipped": misfit, **lim}
                print(f"{name} B={batch} {path}: SKIPPED ({misfit}); {limit_text(lim)}", flush=True)
                save(results, args.json_out)
                continue
            t0 = time.perf_counter()
            decode_tok_s = float("nan")
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            try:
                if ours:
                    warmup = prompts_for(batch, model.config.vocab_size, seed=batch + 10_000, lengths=args.prompt_tokens)
                    elapsed, tokens, decode_tok_s = run_ours(model, prompts, args.new_tokens, args.device, warmup)
                else:
                    elapsed, tokens = run_hf(model, prompts, args.new_tokens, args.device, static=path == "compiled")
            except Exception as exc:  # noqa: BLE001 - one failing path must not lose the others
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
                results["runs"][key] = {"error": error, **lim}
                print(f"{name} B={batch} {path}: FAILED {error}", flush=True)
                save(results, args.json_out)
                del exc
                gc.collect()
                if args.device == "cuda":
                    torch.cuda.empty_cache()
                continue
            tok_s = tokens / elapsed
            row = {"tok_s": tok_s, "timed_s": elapsed, "tokens": tokens, "wall_s_with_warmup": time.perf_counter() - t0,
                   **({"decode_tok_s": decode_tok_s, "decode_vs_limit": decode_tok_s / lim["limit_tok_s"]} if ours else {}),
                   **lim}
            if args.device == "cuda":
                row["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9
            results["runs"][key] = row
            decode = f"; decode {decode_tok_s:,.0f} tokens/s = {row['decode_vs_limit']:.2f} of the " if ours else "; "
            print(f"{name} B={batch} {path}: {tok_s:,.0f} tokens/s ({tokens} tokens in {elapsed:.2f} s; "
                  f"{row['wall_s_with_warmup']:.1f} s with warm-up){decode}{limit_text(lim)}", flush=True)
            save(results, args.json_out)
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
        del model
        gc.collect()
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


def summary_20b(results: dict) -> str:
    """The ``rollout_20b:`` line (see the module docstring); nan for a row not measured."""
    runs = results["runs"]

    def field(batch: int, path: str, name: str) -> str:
        value = runs.get(f"{BIG}_b{batch}_{path}", {}).get(name)
        return "nan" if value is None or math.isnan(value) else f"{value:.0f}"

    return (f"rollout_20b: b8={field(8, 'ours', 'decode_tok_s')} b64={field(64, 'ours', 'decode_tok_s')} "
            f"b256={field(256, 'ours', 'decode_tok_s')} b64_lora={field(64, LORA_PATH, 'decode_tok_s')} "
            f"b256_lora={field(256, LORA_PATH, 'decode_tok_s')} limit_b64={field(64, 'ours', 'limit_tok_s')} "
            f"limit_b256={field(256, 'ours', 'limit_tok_s')}")


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
    big = [k for k in runs if k.startswith(BIG + "_")]
    if big and len(big) == len(runs):  # a 20B run: its own line, last
        return lora_line + summary_20b(results)
    return lora_line + (f"rollout_vs_hf: smollm_b64={fmt(ratio('smollm_b64'))} smollm_b256={fmt(ratio('smollm_b256'))} "
            f"gptoss_b64={fmt(ratio('gptoss_b64'))} gptoss_b256={fmt(ratio('gptoss_b256'))} "
            f"smollm_b256_tok_s={'nan' if math.isnan(ours256) else f'{ours256:.0f}'} retool_gen_share={fmt(share)}"
            + ("\n" + summary_20b(results) if big else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--models", default="smollm,gptoss", type=lambda s: s.split(","))
    parser.add_argument("--batches", default="64,256", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--paths", default=",".join(PATHS), type=lambda s: s.split(","),
                        help=f"of {', '.join(PATHS + (LORA_PATH,))}")
    parser.add_argument("--big-paths", default=f"ours,{LORA_PATH}", type=lambda s: s.split(","),
                        help=f"the paths of {BIG} (default: the decode engine with and without LoRA)")
    parser.add_argument("--lora-rank", type=int, default=16, help="the adapter rank of the ours_lora path")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", default="200-300", type=prompt_range,
                        help="prompt lengths, LO-HI (uniform) or N (2048: a retool context)")
    parser.add_argument("--smollm-layers", type=int, default=None, help="fewer layers for a quick check")
    parser.add_argument("--gptoss-layers", type=int, default=None)
    parser.add_argument("--gptoss20b-layers", type=int, default=None, help="fewer layers of the 20B shape")
    parser.add_argument("--copy-mb", type=int, default=None,
                        help="size of the bandwidth copy (default 2048 MiB on a GPU, 256 on the CPU)")
    parser.add_argument("--headroom-gb", type=float, default=4.0,
                        help="GPU memory a row needs beside its slot cache (activations, logits, graphs)")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--from-json", default=None, help="print the summary of an earlier --json-out")
    parser.add_argument("--retool-metrics", default=None, help="metrics.jsonl of a GPU retool run")
    args = parser.parse_args(argv)
    bad = [p for p in args.paths + args.big_paths if p not in PATHS + (LORA_PATH,)]
    bad += [m for m in args.models if m not in ("smollm", "gptoss", BIG)]
    if bad:
        parser.error(f"unknown paths or models {bad}; paths: {PATHS + (LORA_PATH,)}; models: smollm, gptoss, {BIG}")
    results = json.loads(Path(args.from_json).read_text()) if args.from_json else measure(args)
    if not args.from_json:
        save(results, args.json_out)
    print(summary(results, retool_gen_share(args.retool_metrics)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
