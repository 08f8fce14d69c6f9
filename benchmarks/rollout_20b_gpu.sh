#!/usr/bin/env bash
# Decode throughput of GPT-OSS-20B at full size against the memory-bandwidth limit (issue 31, scope 2), one
# device call, one process: rollout_bench's `gptoss20b` (20.9B parameters, random bf16 weights built on the GPU
# through the meta device), the decode engine without and with LoRA (rank RANK), at BATCHES rows of PROMPT-token
# prompts (a retool context) and NEW_TOKENS new tokens. Each row prints its tokens/s (end to end and decode
# only) next to the limit (bytes per decode step / the copy bandwidth measured in the same process); a row whose
# slot cache cannot fit is skipped with its reason. The last line of bench.log is
#     rollout_20b: b8=<> b64=<> b256=<> b64_lora=<> b256_lora=<> limit_b64=<> limit_b256=<>
# Results go to OUT_DIR: env.txt, bench.log, bench.json (rewritten after every row, so a run stopped by
# LIMIT_S keeps the rows it finished; the summary line of those rows then ends bench.log).
#
# Usage, on the GPU machine from the repo root, with the wheels the device lacks in WHEELS (gymnasium,
# farama-notifications, peft 0.21.2; see FACTS.md "The device machine's Python"):
#     WHEELS=../whl bash benchmarks/rollout_20b_gpu.sh OUT_DIR
# Knobs (environment): BATCHES (8,64,256), PROMPT (2048), NEW_TOKENS (256), RANK (16), PATHS (ours,ours_lora),
# LIMIT_S (540: the benchmark's timeout), PYTHON (python3), DEVICE (cuda), EXTRA (more rollout_bench flags). A check
# of this script on the CPU with the tiny GPT-OSS (the summary line is then rollout_vs_hf's):
#     DEVICE=cpu BATCHES=2 PROMPT=20-30 NEW_TOKENS=8 EXTRA="--models gptoss --gptoss-layers 2 --dtype float32" \
#       bash benchmarks/rollout_20b_gpu.sh /tmp/out
set -uo pipefail
OUT=${1:?usage: $0 OUT_DIR}
mkdir -p "$OUT"
BATCHES=${BATCHES:-8,64,256} PROMPT=${PROMPT:-2048} NEW_TOKENS=${NEW_TOKENS:-256} RANK=${RANK:-16}
PATHS=${PATHS:-ours,ours_lora} LIMIT_S=${LIMIT_S:-540} DEVICE=${DEVICE:-cuda}
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
PY=${PYTHON:-python3}
(date -u; git rev-parse HEAD 2>/dev/null; nvidia-smi -L 2>/dev/null
 $PY -c 'import torch, transformers, peft; print("torch", torch.__version__, "transformers", transformers.__version__,
"peft", peft.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")') 2>&1 | tee "$OUT/env.txt"
# shellcheck disable=SC2086  # EXTRA is a list of flags
timeout "$LIMIT_S" $PY benchmarks/rollout_bench.py --device "$DEVICE" --models gptoss20b --batches "$BATCHES" \
  --prompt-tokens "$PROMPT" --new-tokens "$NEW_TOKENS" --paths "$PATHS" --big-paths "$PATHS" --lora-rank "$RANK" \
  --json-out "$OUT/bench.json" ${EXTRA:-} 2>&1 | tee "$OUT/bench.log"
status=${PIPESTATUS[0]}
if [ "$status" -ne 0 ] && [ -f "$OUT/bench.json" ]; then  # stopped (124: LIMIT_S) or failed: the rows it finished
  echo "rollout_20b_gpu.sh: the benchmark exited with $status; the summary of the rows in $OUT/bench.json:" \
    | tee -a "$OUT/bench.log"
  $PY benchmarks/rollout_bench.py --from-json "$OUT/bench.json" 2>&1 | tee -a "$OUT/bench.log"
fi
exit "$status"
