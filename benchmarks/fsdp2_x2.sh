#!/usr/bin/env bash
# FSDP2 on 2 GPUs (device kind nvidia-h200-x2): step-1 loss/grad-norm parity with one GPU, and step
# times for 1 vs 2 GPUs, on a small GPT-OSS-architecture model (random init, 201,088-token vocabulary).
# Usage (repo root, wheels of the pure-python deps missing on that image in .whl/): bash benchmarks/fsdp2_x2.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: fsdp2_x2.sh OUT_DIR}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast stays off
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi -L
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, "gpus", torch.cuda.device_count())'
MODEL="--layers 8 --hidden 1024 --heads 16 --experts 8 --vocab 201088"
# 1) parity at step 1 (rollout on each rank, same episodes for both updates) + a timed second step
timeout 120 python3 -m torch.distributed.run --standalone --nproc_per_node=2 tests/_fsdp2_parity_worker.py \
  --device cuda --dtype bfloat16 $MODEL --tasks-per-rank 8 --group-size 4 --new-tokens 64 --micro-batch 16 \
  --out "$OUT/parity_bf16.json" 2>&1 | tail -40
# 2) the CLI: agentrl train ... trainer.n_gpus=1 (plain trainer) vs trainer.n_gpus=2 (torchrun + FSDP2)
for n in 1 2; do
  timeout 75 python3 -m agentrl.cli train env=gsm8k model=tiny-gpt-oss device=cuda dtype=bfloat16 trainer.n_gpus=$n \
    trainer.total_steps=3 trainer.save_every=0 trainer.progress=false trainer.tensorboard=false eval.num_tasks=0 \
    rollout.batch_size=16 rollout.n=4 rollout.max_new_tokens=64 actor.micro_batch_size=16 \
    actor.lr=2e-5 rollout.temperature=0.7 \
    model_kwargs.num_layers=8 model_kwargs.hidden=1024 model_kwargs.heads=16 model_kwargs.experts=8 \
    run_dir=/tmp/fsdp2_n$n 2>&1 | tail -15
  cp /tmp/fsdp2_n$n/metrics.jsonl "$OUT/metrics_n$n.jsonl" 2>/dev/null || echo "n_gpus=$n wrote no metrics"
done
