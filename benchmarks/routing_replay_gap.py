"""Rollout-vs-train log-prob gap of a tiny GPT-OSS MoE, with and without routing replay.

rollout: sampled ``generate`` with KV cache (prefill, then one token per step), recording the experts each
         token used (agentrl.models.routing.record_routing); rollout log-probs from its logits.
train:   one full-sequence forward over the same tokens (agentrl.train.logprobs.model_token_logprobs),
         once with natural routing and once replaying the recorded experts (replay_routing).
Gap per generated token: d = logp_train - logp_rollout; reported as mean |d|, max |d| and the k3 KL
estimate mean(exp(d) - d - 1). ``flip_frac`` is the share of (layer, token) expert sets that the natural
train forward chose differently from the rollout.

The model is random-init (seeded); ``--logit-scale`` multiplies the LM head so logits have a trained-like
magnitude (random init gives logits of ~0.2, trained LMs ~10-30), which makes the gap visible.
Run: python benchmarks/routing_replay_gap.py --device cuda
The last line is: routing_replay: no_replay_abs_mean=<x> no_replay_max=<x> no_replay_k3=<x>
                  replay_abs_mean=<x> replay_max=<x> replay_k3=<x> flip_frac=<x>   (one line)
Does not import verl.
"""

from __future__ import annotations

import argparse
import time

import torch

from agentrl.models.routing import record_routing, replay_routing
from agentrl.models.tiny import tiny_gpt_oss
from agentrl.train.logprobs import model_token_logprobs


def gap(train: torch.Tensor, rollout: torch.Tensor) -> tuple[float, float, float]:
    d = (train - rollout).double()
    return d.abs().mean().item(), d.abs().max().item(), (torch.exp(d) - d - 1).mean().item()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--vocab", type=int, default=201088)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--logit-scale", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    model = tiny_gpt_oss(
        num_layers=args.layers,
        hidden=args.hidden,
        experts=args.experts,
        top_k=args.top_k,
        vocab=args.vocab,
        dtype=dtype,
        seed=args.seed,
        device=args.device,
    )
    with torch.no_grad():
        model.lm_head.weight.mul_(args.logit_scale)
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, min(args.vocab, 199998), (args.batch, args.prompt), generator=g).to(args.device)
    attn = torch.ones_like(prompt)

    torch.manual_seed(args.seed)
    t0 = time.time()
    with record_routing(model) as rec, torch.no_grad():
        out = model.generate(
            input_ids=prompt,
            attention_mask=attn,
            do_sample=True,
            top_k=0,
            top_p=1.0,
            temperature=1.0,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    t_gen = time.time() - t0
    seq = out.sequences
    gen = seq[:, args.prompt :]
    rollout_lp = (
        torch.log_softmax(torch.stack(out.logits, dim=1).float(), -1).gather(-1, gen[..., None]).squeeze(-1)
    )
    routing = rec.routing()
    full = torch.ones_like(seq)

    with record_routing(model) as natural, torch.no_grad():
        train_lp, _ = model_token_logprobs(model, seq, full, response_start=args.prompt)
    nat = natural.routing()[:, :, : routing.shape[2]]
    flips = (nat.sort(-1).values != routing.sort(-1).values).any(-1)
    # only positions whose routing shapes a scored log-prob: the prompt's last token onwards
    flip_frac = flips[:, :, args.prompt - 1 :].float().mean().item()
    with replay_routing(model, routing), torch.no_grad():
        replay_lp, _ = model_token_logprobs(model, seq, full, response_start=args.prompt)

    a, b = gap(train_lp, rollout_lp), gap(replay_lp, rollout_lp)
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(
        f"device={dev} torch={torch.__version__} dtype={args.dtype} layers={args.layers} hidden={args.hidden} "
        f"experts={args.experts} top_k={args.top_k} vocab={args.vocab} tokens={args.batch}x{args.new_tokens} "
        f"logit_scale={args.logit_scale} generate_s={t_gen:.1f}"
    )
    print(
        f"routing_replay: no_replay_abs_mean={a[0]:.3e} no_replay_max={a[1]:.3e} no_replay_k3={a[2]:.3e} "
        f"replay_abs_mean={b[0]:.3e} replay_max={b[1]:.3e} replay_k3={b[2]:.3e} flip_frac={flip_frac:.4f}"
    )


if __name__ == "__main__":
    main()
