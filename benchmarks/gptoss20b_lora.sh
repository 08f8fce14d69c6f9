#!/usr/bin/env bash
# GPT-OSS-20B at full size on one H200: `agentrl train` with LoRA, GRPO on long-context retool episodes.
#
# The model is model=gpt-oss-20b-random: GPT-OSS-20B's exact architecture (20.9B parameters), random bf16
# weights built on the GPU through the meta device (nothing to carry). LoRA (actor.lora.*, rank RANK) on the
# attention projections and the fused MoE experts; sink attention with backend="auto" in rollout and training
# (attn_implementation=agentrl_sink: FA4 where its wheels are importable, our Triton kernels otherwise);
# chunked log-probs; gradient checkpointing. Episodes: retool tier=table (a ledger of ROWS entries, ~6.7k-token
# prompts at 800 rows), TURNS turns of at most NEW_TOKENS tokens, so contexts reach ~8k tokens. Reward: the
# env's `correct` plus its dense shaping component `closeness` (weight 1; how close in orders of magnitude the
# last number the model wrote is to the answer): a random model never answers right, but its episodes differ
# in what numbers they contain, so GRPO's advantages and the policy gradient are not zero.
#
# One phase per device call (each fits in ~5 minutes of device time, see the estimate in the LoRA report):
#     PHASE=replay   STEPS=5 (default): routing replay on  -> OUT/replay/
#     PHASE=noreplay STEPS=2           : routing replay off -> OUT/noreplay/ (the gap without replay)
# then, anywhere: python benchmarks/gptoss20b_report.py OUT  (the summary line; either phase alone works).
#
# Usage (repo root on the GPU machine; wheels of the pure-python deps missing there in .whl/, peft 0.21.2
# among them, see FACTS.md "The device machine's Python"):
#     PHASE=replay bash benchmarks/gptoss20b_lora.sh OUT_DIR [key=value ...]   (extra keys override)
# Knobs (environment): PHASE, STEPS, RANK (16), ROWS (800), TURNS (2), NEW_TOKENS (256), TASKS (2 per step),
# GROUP (4 samples per task), MICRO (2 sequences per forward), LIMIT_S (285: the training command's timeout).
# Output in OUT_DIR/<phase>/: metrics.jsonl, config.yaml, gpu_mem.csv (nvidia-smi every 0.5 s), contexts.json
# (longest prompt+response per step), train.log (the last 400 lines).
set -uo pipefail
OUT=${1:?usage: PHASE=replay|noreplay $0 OUT_DIR [key=value ...]}
shift
PHASE=${PHASE:-replay}
case $PHASE in
  replay) REPLAY=true; STEPS=${STEPS:-5} ;;
  noreplay) REPLAY=false; STEPS=${STEPS:-2} ;;
  *) echo "PHASE must be replay or noreplay, got $PHASE" >&2; exit 2 ;;
esac
RANK=${RANK:-16} ROWS=${ROWS:-800} TURNS=${TURNS:-2} NEW_TOKENS=${NEW_TOKENS:-256} TASKS=${TASKS:-2}
GROUP=${GROUP:-4} MICRO=${MICRO:-2} LIMIT_S=${LIMIT_S:-285}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast stays off
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
DIR="$OUT/$PHASE"
RUN=/tmp/gptoss20b_$PHASE
mkdir -p "$DIR"
rm -rf "$RUN"
python3 -c 'import torch, transformers, peft; print("torch", torch.__version__, "transformers", transformers.__version__,
"peft", peft.__version__, "gpu", torch.cuda.get_device_name(0))'
SANDBOX=local
command -v bwrap >/dev/null || SANDBOX=unsafe_local  # a random model calls no tool; the sandbox only has to start

nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms 500 > "$DIR/gpu_mem.csv" &
SMI=$!
timeout "$LIMIT_S" python3 -m agentrl.cli train env=retool model=gpt-oss-20b-random device=cuda dtype=bfloat16 \
  attn_implementation=agentrl_sink run_dir="$RUN" seed=0 \
  actor.lora.rank="$RANK" actor.lora.alpha=$((2 * RANK)) actor.lr=1e-5 \
  actor.routing_replay=$REPLAY actor.gradient_checkpointing=true actor.logprob_chunk_size=1024 \
  actor.micro_batch_size="$MICRO" \
  env_kwargs.tier=table env_kwargs.table_rows="$ROWS" env_kwargs.closeness=1.0 env_kwargs.sandbox=$SANDBOX \
  rollout.batch_size="$TASKS" rollout.n="$GROUP" rollout.max_turns="$TURNS" rollout.max_new_tokens="$NEW_TOKENS" \
  rollout.temperature=1.0 rollout.max_batch_size=$((TASKS * GROUP)) \
  trainer.total_steps="$STEPS" trainer.save_every=0 trainer.max_wall_s=0 trainer.progress=false \
  trainer.tensorboard=false eval.num_tasks=0 sft.steps=0 "$@" > "$RUN.log" 2>&1
STATUS=$?
kill "$SMI" 2>/dev/null
tail -n 400 "$RUN.log" > "$DIR/train.log"
cp "$RUN/metrics.jsonl" "$RUN/config.yaml" "$DIR/" 2>/dev/null || echo "the run wrote no metrics (exit $STATUS)"
python3 - "$RUN" "$DIR/contexts.json" <<'EOF'
import glob, json, os, sys
run, out = sys.argv[1], sys.argv[2]
longest = {}
for path in sorted(glob.glob(os.path.join(run, "trajectories", "step_*.jsonl"))):
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    longest[os.path.basename(path)] = max(len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows) if rows else 0
json.dump(longest, open(out, "w"), indent=1)
print("longest context per step:", longest)
EOF
tail -n 25 "$DIR/train.log"
echo "gptoss20b_lora phase=$PHASE exit=$STATUS"
exit $STATUS
