#!/usr/bin/env bash
# verl for real on GPUs: `agentrl train backend=verl env=retool verl.rollout=agentrl` (verl 0.9.1's main_ppo:
# Ray, FSDP2, our agent loop, rollout, on-policy loss and sink attention on a GPT-OSS-architecture model)
# with checkpoints, then the step-1 loss/grad-norm comparison with the embedded trainer on the same
# episodes, `resume=` from the latest checkpoint, a short embedded run for the per-step figures side by
# side, and a report (in this order; a phase that would not fit in BUDGET_S is skipped).
#
# Usage, on the GPU machine, from the bundle folder written by benchmarks/verl_gpu_bundle.py:
#     bash run/verl_gpu_run.sh OUT_DIR
# Every GPU of the machine is used (trainer.n_gpus_per_node = GPU count: FSDP over all of them).
# Knobs (environment): STEPS (20), SAVE_EVERY (5), RESUME_STEPS (3), EMBEDDED_STEPS (10), BATCH (8),
# GROUP (4), NEW_TOKENS (48), TURNS (2), LAYERS (4), HIDDEN (256), EXPERTS (8), TASKS (512 training tasks
# in verl's dataset), BUDGET_S (450), AFTER_S (150: seconds kept for the phases after the first launch),
# STALL_S (180: a training launch that prints nothing for this long is stopped, so a hang cannot eat the
# budget), EMBEDDED_PARALLEL (0; 1: the embedded run goes beside verl's start-up, minutes of CPU-side
# work before verl touches the GPU, instead of after the resume). Each verl launch spends about 2.5 min
# starting on one H200 (Ray, workers, FSDP) and its first step about 1 min more (kernel compilation).
# For a rehearsal without GPUs (tests/_verl_cpu_platform.py): RAY_STOP=0 (see ray_stop below)
# GPUS=1 DEVICE=cpu DTYPE=float32 ATTN=eager EXTRA_OVERRIDES=,trainer.device=cpu,... plus the platform's
# environment (see tests/test_verl_main_ppo_cpu.py).
# If the bundle carries site.tar.xz in parts (site.tar.xz.part-aa, -ab, ...), each call stages the parts
# it carries in /tmp/verl_parts and the run starts once all parts of MANIFEST.txt are there.
# Output in OUT_DIR: report.md, verl_metrics.jsonl, embedded_metrics.jsonl, step1.json, logs.tar.xz (every
# log, also when a phase fails or the script exits early; the verl run's config.yaml, verl_config.yaml,
# tensorboard/ and hydra/), run_meta.txt. The last line printed is
#     verl_run: gpus=<n> steps=<n> resumed=<yes|no> step1_loss_rel_diff_vs_embedded=<x>
set -uo pipefail
OUT=${1:?usage: verl_gpu_run.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
BUNDLE=$(cd "$(dirname "$0")/.." && pwd)
RUNS=$(cd "$(dirname "$0")" && pwd)
T0=$SECONDS
BUDGET_S=${BUDGET_S:-450}
STALL_S=${STALL_S:-180}
STEPS=${STEPS:-20} SAVE_EVERY=${SAVE_EVERY:-5} RESUME_STEPS=${RESUME_STEPS:-3} EMBEDDED_STEPS=${EMBEDDED_STEPS:-10}
BATCH=${BATCH:-8} GROUP=${GROUP:-4} NEW_TOKENS=${NEW_TOKENS:-48} TURNS=${TURNS:-2}
LAYERS=${LAYERS:-4} HIDDEN=${HIDDEN:-256} EXPERTS=${EXPERTS:-8} TASKS=${TASKS:-512}
AFTER_S=${AFTER_S:-150} EMBEDDED_PARALLEL=${EMBEDDED_PARALLEL:-0}
DEVICE=${DEVICE:-cuda} DTYPE=${DTYPE:-bfloat16} ATTN=${ATTN:-agentrl_sink} EXTRA_OVERRIDES=${EXTRA_OVERRIDES:-}
SITE=/tmp/verl_site WORK=/tmp/verl_work LOGS=$OUT/logs
MODEL=$WORK/model RUN=$WORK/verl_run EMB=$WORK/embedded_run
mkdir -p "$WORK" "$LOGS"
log() { echo "[verl_gpu_run +$((SECONDS - T0))s] $*"; }
left() { echo $((BUDGET_S - (SECONDS - T0))); }
pack_logs() { [ -d "$LOGS" ] && tar -cJf "$OUT/logs.tar.xz" -C "$OUT" logs && rm -rf "$LOGS"; true; }
trap pack_logs EXIT  # the logs come back as one file whatever happens (the device returns at most 8 files)

# watched LIMIT_S LOG CMD...: CMD's exit code, its output in LOG; stopped (124) after LIMIT_S seconds, or
# once LOG has not grown for STALL_S seconds (a hang, e.g. Ray waiting for resources it will never get).
watched() {
  local limit=$1 logf=$2 waited=0 quiet=0 size last=-1 pid
  shift 2
  setsid "$@" > "$logf" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 2; waited=$((waited + 2))
    size=$(stat -c %s "$logf" 2>/dev/null || echo 0)
    if [ "$size" = "$last" ]; then quiet=$((quiet + 2)); else quiet=0; last=$size; fi
    if [ $waited -ge "$limit" ] || [ $quiet -ge "$STALL_S" ]; then
      log "stopping ($logf) after $waited s ($quiet s without output; limit $limit s, stall limit $STALL_S s)"
      kill -TERM -- "-$pid" 2>/dev/null; sleep 5; kill -KILL -- "-$pid" 2>/dev/null
      wait "$pid" 2>/dev/null
      return 124
    fi
  done
  wait "$pid"
}

# NVLink multicast stays off (device rules); unbuffered Python; no network.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export RAY_USAGE_STATS_ENABLED=0 RAY_DEDUP_LOGS=1 WANDB_MODE=disabled AGENTRL_CACHE=$WORK/cache

# ---------------------------------------------------------------- 1. the site folder (Ray, verl, agentrl, ...)
archive=""
if [ -f "$BUNDLE/site.tar.xz" ]; then
  archive=$BUNDLE/site.tar.xz
else
  mkdir -p /tmp/verl_parts
  for part in "$BUNDLE"/site.tar.xz.part-*; do [ -f "$part" ] && cp -v "$part" /tmp/verl_parts/; done
  missing=0
  for part in $(awk '/^site.tar.xz.part-/ {print $1}' "$BUNDLE/MANIFEST.txt"); do
    [ -f "/tmp/verl_parts/$part" ] || { log "part $part not here yet"; missing=1; }
  done
  if [ $missing = 1 ]; then log "parts staged in /tmp/verl_parts; run the next call now (30 s warm window)"; exit 0; fi
  cat /tmp/verl_parts/site.tar.xz.part-* > /tmp/site.tar.xz && archive=/tmp/site.tar.xz
fi
want=$(awk '$1 == "site.tar.xz" {print $3}' "$BUNDLE/MANIFEST.txt")
if [ ! -f "$SITE/.sha256" ] || [ "$(cat "$SITE/.sha256")" != "$want" ]; then
  got=$(sha256sum "$archive" | cut -d' ' -f1)
  [ "$got" = "$want" ] || { log "FAIL: $archive sha256 $got != MANIFEST $want"; exit 1; }
  rm -rf "$SITE" && mkdir -p "$SITE"
  log "unpacking $(du -h "$archive" | cut -f1) into $SITE"
  tar -xJf "$archive" -C "$SITE" || { log "FAIL: unpacking"; exit 1; }
  echo "$want" > "$SITE/.sha256"
fi
export PYTHONPATH=$SITE${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}
cd "$WORK"  # never the repo checkout: its agentrl must not shadow the bundle's (and Ray workers start here)
GPUS=${GPUS:-$(nvidia-smi -L | grep -c "^GPU")}
NCPU=$(nproc)
RAY_CPUS=${RAY_CPUS:-$(( NCPU > 16 ? NCPU : 16 ))}  # a scheduling count: verl's TransferQueue alone takes 4 "CPUs"
{ nvidia-smi -L 2>/dev/null; echo "gpus $GPUS cpus $NCPU ray_cpus $RAY_CPUS"; } > "$OUT/run_meta.txt"

# After each launch, `ray stop --force` ends whatever Ray processes a stopped launch left behind: every Ray
# process of the machine, so RAY_STOP=0 on a shared machine (a CPU rehearsal), where others may run Ray.
ray_stop() { [ "${RAY_STOP:-1}" = 1 ] && timeout 60 python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1; true; }

# ---------------------------------------------------------------- 2. preflight: imports, plugin, versions
log "preflight (gpus=$GPUS cpus=$NCPU), in the background while the model is written"
timeout 180 python3 - "$DEVICE" > "$LOGS/preflight.out" 2> "$LOGS/preflight.err" <<'EOF' &
import importlib.metadata as md, sys
import torch
assert sys.argv[1] != "cuda" or torch.cuda.is_available(), "torch sees no GPU"
import ray, transformers, verl, tensordict, transfer_queue  # noqa: F401
import agentrl
from agentrl.train.verl_backend import plugin
assert agentrl.__file__.startswith("/tmp/verl_site/"), f"agentrl from {agentrl.__file__}, not the bundle"
assert not plugin.FAILED, f"plugin parts failed: {plugin.FAILED}"
need = {"agent_loop", "policy_loss", "attention", "rollout", "tracking"}
assert need <= set(plugin.REGISTERED), f"plugin registered only {sorted(plugin.REGISTERED)}"
print("python", sys.version.split()[0])
for name in ("torch", "triton", "transformers", "tokenizers", "ray", "verl", "tensordict", "transferqueue",
             "agentrl-sdk", "numpy", "protobuf", "peft", "accelerate"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "missing")
print("plugin", dict(plugin.REGISTERED))
EOF
preflight_pid=$!

# ---------------------------------------------------------------- 3. a tiny GPT-OSS checkpoint (random init, bf16)
if [ ! -f "$MODEL/config.json" ]; then
  log "model: GPT-OSS architecture, $LAYERS layers, hidden $HIDDEN, $EXPERTS experts top-2, o200k_harmony vocabulary"
  timeout 180 python3 - "$MODEL" "$LAYERS" "$HIDDEN" "$EXPERTS" > "$LOGS/model.log" 2>&1 <<'EOF'
import sys
import torch
from agentrl.harmony.hf_tokenizer import harmony_hf_tokenizer
from agentrl.models.tiny import tiny_gpt_oss
out, layers, hidden, experts = sys.argv[1], *map(int, sys.argv[2:])
model = tiny_gpt_oss(num_layers=layers, hidden=hidden, experts=experts, top_k=2, seed=0, dtype=torch.bfloat16)
model.config.architectures = ["GptOssForCausalLM"]
model.save_pretrained(out)
harmony_hf_tokenizer().save_pretrained(out)
print("parameters", sum(p.numel() for p in model.parameters()))
EOF
  rc=$?; cat "$LOGS/model.log" | tail -3
  [ $rc = 0 ] || { log "FAIL: model rc=$rc"; exit 1; }
fi
wait $preflight_pid; rc=$?
cat "$LOGS/preflight.out" >> "$OUT/run_meta.txt"; cat "$OUT/run_meta.txt"
if [ $rc != 0 ]; then log "FAIL: preflight rc=$rc"; tail -30 "$LOGS/preflight.err"; exit 1; fi

# ---------------------------------------------------------------- 4. verl: STEPS GRPO steps, checkpoints every SAVE_EVERY
COMMON=(env=retool "model=$MODEL" verl.rollout=agentrl "attn_implementation=$ATTN"
        "trainer.n_gpus_per_node=$GPUS" "rollout.batch_size=$BATCH" "rollout.n=$GROUP"
        "rollout.max_new_tokens=$NEW_TOKENS" "rollout.max_turns=$TURNS" actor.entropy_coeff=0.01 seed=0)
VERL=(backend=verl "${COMMON[@]}" "trainer.save_every=$SAVE_EVERY" verl.max_prompt_length=1024
      verl.max_response_length=512 "verl.n_train_tasks=$TASKS" verl.n_val_tasks=8 verl.agent_workers=2
      "verl.overrides=[actor_rollout_ref.actor.fsdp_config.use_torch_compile=false,ray_kwargs.ray_init.num_cpus=$RAY_CPUS,+ray_kwargs.ray_init.num_gpus=$GPUS,+ray_kwargs.ray_init.include_dashboard=false,transfer_queue.backend.SimpleStorage.num_data_storage_units=2$EXTRA_OVERRIDES]")
FILTER='^(rollout backend|  why|run directory|resume:|Traceback|.*Error|.*error:|.*Resuming from|.*Training from scratch|.*Saving checkpoint to|.*step:[0-9]+ )'
short() { grep -E "$FILTER" | sed -E 's/^(.*step:[0-9]+) - .*(actor\/grad_norm:[^ ]+).*(timing_s\/step:[^ ]+).*/\1 \2 \3/' | cut -c1-300; }

embedded_run() {  # embedded_run LIMIT_S: the embedded trainer with the same settings, for the figures side by side
  rm -rf "$EMB"
  timeout "$1" python3 -m agentrl.cli train "${COMMON[@]}" "device=$DEVICE" "dtype=$DTYPE" \
    "trainer.total_steps=$EMBEDDED_STEPS" trainer.save_every=0 eval.num_tasks=0 trainer.progress=false \
    "run_dir=$EMB" > "$LOGS/embedded.log" 2>&1
}
embedded_done() {  # embedded_done RC
  log "embedded run rc=$1"
  grep -E "^step " "$LOGS/embedded.log" | tail -3
  [ "$1" = 0 ] || tail -20 "$LOGS/embedded.log" | cut -c1-300
  cp "$EMB/metrics.jsonl" "$OUT/embedded_metrics.jsonl" 2>/dev/null
}

rm -rf "$RUN"; ray_stop
emb_pid=""
if [ "$EMBEDDED_PARALLEL" = 1 ]; then
  # beside verl's start-up (Ray, workers: minutes of CPU-side work before verl touches the GPU)
  log "embedded run: $EMBEDDED_STEPS steps, started beside verl's launch"
  embedded_run $(( $(left) - AFTER_S > 60 ? $(left) - AFTER_S : 60 )) &
  emb_pid=$!
fi
log "verl run: $STEPS steps on $GPUS GPU(s)"
TRAIN=(python3 -m agentrl.cli train "${VERL[@]}" "trainer.total_steps=$STEPS" "run_dir=$RUN")
log "command: $(printf '%q ' "${TRAIN[@]}")"
watched $(( $(left) - AFTER_S > 120 ? $(left) - AFTER_S : 120 )) "$LOGS/verl_train.log" "${TRAIN[@]}"
train_rc=$?
short < "$LOGS/verl_train.log" | tail -40
NOISE='target_num_threads|UserWarning|warnings.warn|SimpleStorageUnit|Per-operation|Time range|perf_utils'
[ $train_rc = 0 ] || grep -vE "$NOISE" "$LOGS/verl_train.log" | tail -60 | cut -c1-300
ray_stop
log "verl run rc=$train_rc, metrics steps: $(python3 -c "import json;print([json.loads(l)['step'] for l in open('$RUN/metrics.jsonl')])" 2>/dev/null)"
steps_done=$(python3 -c "import json;print(max(json.loads(l)['step'] for l in open('$RUN/metrics.jsonl')))" 2>/dev/null || echo 0)

# ---------------------------------------------------------------- 5. step 1: verl vs the embedded trainer, same episodes
if [ -f "$RUN/metrics.jsonl" ] && [ "$(left)" -gt 40 ]; then
  log "step-1 comparison on verl's step-1 episodes"
  timeout $(( $(left) > 120 ? 120 : $(left) )) python3 "$RUNS/verl_step1_compare.py" --run "$RUN" --model "$MODEL" \
    --device "$DEVICE" --dtype "$DTYPE" --out "$OUT/step1.json" > "$LOGS/step1.log" 2>&1
  cmp_rc=$?
  log "step-1 comparison rc=$cmp_rc"; grep -E "^step1" "$LOGS/step1.log"
  [ $cmp_rc = 0 ] || tail -20 "$LOGS/step1.log" | cut -c1-300
fi

# ---------------------------------------------------------------- 6. resume= for RESUME_STEPS more steps
resumed=no
if [ -f "$RUN/checkpoints/latest_checkpointed_iteration.txt" ] && [ "$(left)" -gt 120 ]; then
  ckpt=$(cat "$RUN/checkpoints/latest_checkpointed_iteration.txt")
  total=$(( (ckpt > steps_done ? ckpt : steps_done) + RESUME_STEPS ))  # past every step already logged
  log "resume=$RUN trainer.total_steps=$total"
  log "command: python3 -m agentrl.cli train resume=$RUN trainer.total_steps=$total"
  watched $(( $(left) - 90 > 90 ? $(left) - 90 : 90 )) "$LOGS/verl_resume.log" python3 -m agentrl.cli train \
    "resume=$RUN" "trainer.total_steps=$total"
  resume_rc=$?
  short < "$LOGS/verl_resume.log" | tail -12
  [ $resume_rc = 0 ] || grep -vE "$NOISE" "$LOGS/verl_resume.log" | tail -40 | cut -c1-300
  ray_stop
  last=$(python3 -c "import json;print(max(json.loads(l)['step'] for l in open('$RUN/metrics.jsonl')))" 2>/dev/null || echo 0)
  if [ $resume_rc = 0 ] && [ "$last" = "$total" ] && grep -q "Resuming from" "$LOGS/verl_resume.log"; then
    resumed=yes; steps_done=$last
  fi
  log "resume rc=$resume_rc, last step $last, resumed=$resumed"
else
  log "SKIP resume: no checkpoint or no time left ($(left) s)"
fi
cp "$RUN/metrics.jsonl" "$OUT/verl_metrics.jsonl" 2>/dev/null
mkdir -p "$LOGS/verl_run" && cp -r "$RUN/config.yaml" "$RUN/verl_config.yaml" "$RUN/tensorboard" "$RUN/hydra" \
  "$LOGS/verl_run/" 2>/dev/null  # what was run, and verl's metrics as TensorBoard events
mkdir -p "$LOGS/verl_run/trajectories" && cp "$RUN"/trajectories/step_000001-* "$LOGS/verl_run/trajectories/" 2>/dev/null
{ echo "--- verl run directory"; (cd "$RUN" 2>/dev/null && ls -la . tensorboard checkpoints hydra 2>&1 | cut -c1-160)
  du -sh "$RUN"/checkpoints/global_step_* 2>/dev/null; } >> "$OUT/run_meta.txt"

# ---------------------------------------------------------------- 7. the embedded trainer, same settings, for the figures side by side
if [ -n "$emb_pid" ]; then
  wait $emb_pid; embedded_done $?  # started beside verl's launch
elif [ "$(left)" -gt 70 ]; then
  log "embedded run: $EMBEDDED_STEPS steps"
  embedded_run $(( $(left) - 15 )); embedded_done $?
else
  log "SKIP embedded run: $(left) s left"
fi

# ---------------------------------------------------------------- 8. report
args=(--verl "$RUN" --gpus "$GPUS" --resumed "$resumed")
[ -f "$EMB/metrics.jsonl" ] && args+=(--embedded "$EMB")
[ -f "$OUT/step1.json" ] && args+=(--step1 "$OUT/step1.json")
python3 "$RUNS/verl_run_report.py" "${args[@]}" > "$OUT/report.md" 2> "$LOGS/report.err"
pack_logs
grep -E "means over|^step1|rel_diff" "$OUT/report.md" | cut -c1-400
log "done (train rc=$train_rc)"
rel=$(python3 -c "import json;print(f\"{json.load(open('$OUT/step1.json'))['loss']['rel_diff']:.3g}\")" 2>/dev/null || echo nan)
echo "verl_run: gpus=$GPUS steps=$steps_done resumed=$resumed step1_loss_rel_diff_vs_embedded=$rel"
