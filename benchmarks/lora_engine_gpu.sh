#!/usr/bin/env bash
# The decode engine's LoRA path on one GPU (issue 31, scope 1), one device call of about 3-4 minutes:
# tests/test_engine_lora_gpu.py (bf16/fp32 log-probs against the PEFT forward, an adapter update seen without
# recapture, greedy tokens, auto picking the engine), then rollout_bench's `ours` against `ours_lora` (rank 16)
# on the tiny GPT-OSS shape at B=64. Results go to OUT_DIR: env.txt, tests_lora.log (the `lora_gpu_gap` lines
# give the measured gaps), bench.log and bench.json (the `lora_decode:` line).
#
# Usage, on the GPU machine from the repo root, with the wheels the device lacks in WHEELS (gymnasium,
# farama-notifications, peft 0.21.2; see FACTS.md "The device machine's Python"):
#     WHEELS=../whl bash benchmarks/lora_engine_gpu.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: $0 OUT_DIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
(date -u; git rev-parse HEAD 2>/dev/null; nvidia-smi -L
 python3 -c 'import torch, transformers, peft; print("torch", torch.__version__, "transformers", transformers.__version__,
"peft", peft.__version__, torch.cuda.get_device_name())') 2>&1 | tee "$OUT/env.txt"
timeout "${TEST_LIMIT_S:-150}" python3 -m pytest -q -s -p no:cacheprovider tests/test_engine_lora_gpu.py 2>&1 \
  | tee "$OUT/tests_lora.log" | grep -E "lora_gpu_gap|passed|failed|Error"
timeout "${BENCH_LIMIT_S:-120}" python3 benchmarks/rollout_bench.py --models gptoss --batches 64 \
  --paths ours,ours_lora --lora-rank 16 --json-out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
