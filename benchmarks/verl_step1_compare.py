"""Step 1 of a verl run (`agentrl train backend=verl ...`) next to agentrl's embedded trainer on identical inputs.

Inputs: the verl run directory (its ``config.yaml``, verl's step-1 metrics in ``metrics.jsonl`` and the
step-1 episodes the agent loop saved in ``trajectories/step_000001-*.jsonl``) and the initial model
directory verl started from. The embedded trainer's update (:func:`agentrl.train.update.run_update`)
runs once on exactly those episodes (same token ids, masks, rollout log-probs, rewards, GRPO groups =
verl's prompt uids) from the same initial weights, with the run's own config (loss, aggregation,
entropy coefficient, clipping, learning rate), and its step-1 figures are compared with verl's:

- loss: verl's ``actor/loss`` (policy loss minus ``entropy_coeff`` x entropy, summed over
  micro-batches) vs the embedded ``actor/pg_loss - entropy_coeff * actor/entropy``;
- ``actor/pg_loss`` and ``actor/grad_norm`` (before clipping) on both sides.

With ``--reference-attn eager`` (the default when the run used ``agentrl_sink``) the embedded update also
runs with transformers' eager attention (which implements GPT-OSS's sinks in plain PyTorch) on the same
episodes: ``embedded_reference`` and its relative differences check the sink kernel inside the model, in
the run's dtype, independently of verl.

Relative difference: ``|verl - embedded| / max(|verl|, |embedded|)`` (0 when both are 0). Prints a JSON
record, then the summary line (and, with a reference, one more line)::

    step1: loss verl=<x> embedded=<y> rel_diff=<r>  grad_norm verl=<a> embedded=<b> rel_diff=<s>

Usage (on a GPU machine, after the verl run):
    python benchmarks/verl_step1_compare.py --run RUN_DIR --model MODEL_DIR [--device cuda]
        [--dtype bfloat16] [--attn agentrl_sink] [--reference-attn eager|none] [--out step1.json]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys


def rel_diff(a: float, b: float) -> float:
    """``|a - b| / max(|a|, |b|)``, 0 when both are 0."""
    scale = max(abs(a), abs(b))
    return 0.0 if scale == 0 else abs(a - b) / scale


def step_episodes(run_dir: str, step: int = 1):
    """The trajectories verl trained on at ``step`` and their GRPO group ids (ints, by prompt uid)."""
    from agentrl.rundir import load_trajectories

    files = sorted(glob.glob(os.path.join(run_dir, "trajectories", f"step_{step:06d}-*.jsonl")))
    if not files:
        raise SystemExit(f"no trajectories for step {step} under {run_dir}/trajectories (trainer.save_trajectories?)")
    trajs = [t for f in files for t in load_trajectories(f).records]
    uids: dict[str, int] = {}
    groups = [uids.setdefault(str(t.group), len(uids)) for t in trajs]
    return trajs, groups


def verl_metrics(run_dir: str, step: int = 1) -> dict:
    from agentrl.rundir import read_metrics

    for record in read_metrics(run_dir):
        if record["step"] == step:
            return record
    raise SystemExit(f"verl logged no step {step} in {run_dir}/metrics.jsonl")


def embedded_step(run_dir: str, model_dir: str, device: str, dtype: str, attn: str | None) -> dict:
    """One embedded-trainer update on verl's step-1 episodes; returns its metrics."""
    import torch
    from omegaconf import OmegaConf

    from agentrl.models.loading import load_model
    from agentrl.train.batch import collate
    from agentrl.train.config import build_config
    from agentrl.train.update import run_update

    cfg = build_config([], base=OmegaConf.load(os.path.join(run_dir, "config.yaml")))
    trajs, groups = step_episodes(run_dir)
    torch.manual_seed(int(cfg.seed))
    loaded = load_model(model_dir, device=device, dtype=dtype, attn_implementation=attn)
    model = loaded.model.train()
    pad = getattr(loaded.tokenizer, "pad_token_id", None) if loaded.tokenizer is not None else None
    batch = collate(trajs, groups, int(pad if pad is not None else 0)).to(model.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.actor.lr, betas=tuple(cfg.actor.betas),
                                  weight_decay=cfg.actor.weight_decay)
    metrics = run_update(model=model, optimizer=optimizer, batch=batch, cfg=cfg,
                         temperature=cfg.rollout.temperature, generator=torch.Generator().manual_seed(cfg.seed)).metrics
    metrics["episodes"] = len(trajs)
    metrics["groups"] = len(set(groups))
    metrics["model_tokens"] = int(batch.response_mask.sum())
    metrics["entropy_coeff"] = float(cfg.actor.entropy_coeff)
    metrics["attn_implementation"] = loaded.attn_implementation
    return metrics


def compare(verl: dict, ours: dict, reference: dict | None = None) -> dict:
    coeff = ours["entropy_coeff"]
    ours_loss = ours["actor/pg_loss"] - coeff * ours["actor/entropy"]
    out: dict = {
        "episodes": ours["episodes"], "groups": ours["groups"], "model_tokens": ours["model_tokens"],
        "entropy_coeff": coeff,
        "loss": {"verl": verl.get("actor/loss"), "embedded": ours_loss},
        "pg_loss": {"verl": verl.get("actor/pg_loss"), "embedded": ours["actor/pg_loss"]},
        "grad_norm": {"verl": verl.get("actor/grad_norm"), "embedded": ours["actor/grad_norm"]},
        "entropy": {"verl_train_forward": verl.get("actor/entropy_loss"), "verl_old_log_prob_pass": verl.get("actor/entropy"),
                    "embedded": ours["actor/entropy"]},
    }
    for key in ("loss", "pg_loss", "grad_norm"):
        pair = out[key]
        if pair["verl"] is None:
            raise SystemExit(f"verl's step 1 has no {key} metric (keys: actor/loss, actor/pg_loss, actor/grad_norm)")
        pair["rel_diff"] = rel_diff(float(pair["verl"]), float(pair["embedded"]))
    if reference is not None:
        ref = {"attn_implementation": reference["attn_implementation"],
               "loss": reference["actor/pg_loss"] - coeff * reference["actor/entropy"],
               "grad_norm": reference["actor/grad_norm"], "entropy": reference["actor/entropy"]}
        for key in ("loss", "grad_norm"):
            ref[f"{key}_rel_diff_vs_embedded"] = rel_diff(float(ref[key]), float(out[key]["embedded"]))
            ref[f"{key}_rel_diff_vs_verl"] = rel_diff(float(ref[key]), float(out[key]["verl"]))
        out["embedded_reference"] = ref
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="the verl run directory")
    ap.add_argument("--model", required=True, help="the initial model directory the verl run started from")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attn", default=None, help="attention implementation (default: the run's)")
    ap.add_argument("--reference-attn", default=None,
                    help="also run the embedded update with this attention (default: eager when --attn is agentrl_sink)")
    ap.add_argument("--out", default=None, help="also write the JSON record here")
    args = ap.parse_args(argv)
    from omegaconf import OmegaConf

    from agentrl.train.verl_backend.config_map import SINK_ATTENTION, is_gpt_oss

    saved = OmegaConf.load(os.path.join(args.run, "config.yaml"))  # verl's attention: the same rule as launch
    attn = args.attn or saved.get("attn_implementation") or (SINK_ATTENTION if is_gpt_oss(args.model) else None)
    reference_attn = args.reference_attn or ("eager" if attn == SINK_ATTENTION else None)
    ours = embedded_step(args.run, args.model, args.device, args.dtype, attn)
    reference = None
    if reference_attn and reference_attn != "none":
        reference = embedded_step(args.run, args.model, args.device, args.dtype, reference_attn)
    result = compare(verl_metrics(args.run), ours, reference)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    loss, gn = result["loss"], result["grad_norm"]
    print(f"step1: loss verl={loss['verl']:.6g} embedded={loss['embedded']:.6g} rel_diff={loss['rel_diff']:.3g}  "
          f"grad_norm verl={gn['verl']:.6g} embedded={gn['embedded']:.6g} rel_diff={gn['rel_diff']:.3g}", flush=True)
    if "embedded_reference" in result:
        ref = result["embedded_reference"]
        print(f"step1 reference ({ref['attn_implementation']}): loss={ref['loss']:.6g} "
              f"rel_diff_vs_embedded={ref['loss_rel_diff_vs_embedded']:.3g}  grad_norm={ref['grad_norm']:.6g} "
              f"rel_diff_vs_embedded={ref['grad_norm_rel_diff_vs_embedded']:.3g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
