#!/usr/bin/env bash
# One-GPU run of the embedded trainer on a random-init GPT-OSS-architecture model (sink attention, MoE
# router, o200k_harmony tokenizer through agentrl.harmony), bf16, plus a routing-replay run.
# Usage: examples/train_gpu_tiny_gpt_oss.sh OUT_DIR
set -euo pipefail
OUT=${1:?usage: $0 OUT_DIR}
COMMON=(env=gsm8k model=tiny-gpt-oss device=cuda dtype=bfloat16 trainer.progress=false
        trainer.max_wall_s=0 model_kwargs.num_layers=4 model_kwargs.hidden=256 model_kwargs.experts=8
        model_kwargs.heads=8 model_kwargs.kv_heads=2 rollout.max_new_tokens=96 rollout.temperature=1.0
        actor.lr=2e-5)  # the lr of the recorded run (device=cuda defaults to 1e-6)
# 1) the main loop: 16 tasks x 8 samples per step, on-policy (one optimizer step per batch)
python3 -m agentrl.cli train "${COMMON[@]}" run_dir="$OUT/gpt_oss_onpolicy" rollout.batch_size=16 rollout.n=8 \
  trainer.total_steps=6 eval.num_tasks=64 actor.micro_batch_size=32 rollout.max_batch_size=128
# 2) off-policy (2 epochs x 2 mini-batches) with rollout routing replay and token-level TIS
python3 -m agentrl.cli train "${COMMON[@]}" run_dir="$OUT/gpt_oss_replay" rollout.batch_size=8 rollout.n=8 \
  trainer.total_steps=3 eval.num_tasks=0 actor.ppo_epochs=2 actor.num_mini_batches=2 actor.routing_replay=true \
  algorithm.rollout_correction.rollout_is=token actor.micro_batch_size=32 rollout.max_batch_size=128
python3 -m agentrl.cli plot "$OUT/gpt_oss_onpolicy" "$OUT/gpt_oss_replay" --out "$OUT/plots"
