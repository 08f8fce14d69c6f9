#!/usr/bin/env bash
# Print the test tiers (pytest markers, see tests/conftest.py) whose code changed, one per line.
#
#   scripts/changed_tiers.sh            # compare HEAD with HEAD~N (N = AGENTRL_CI_DIFF_COMMITS, default 10)
#   AGENTRL_CI_TIERS=all scripts/changed_tiers.sh   # every tier; AGENTRL_CI_TIERS="kernels" forces a list
#
# Base of the comparison: CI runs on a fresh clone of main, and which earlier state passed CI is unknown, so
# the window is the last N commits along the first parent (`HEAD~N`): a merge counts as one commit there,
# with its whole branch. Unsure means run the tier: when HEAD~N does not exist (a shallow or short history)
# or git fails, every tier runs, and so does every tier when the test machinery itself (tests/conftest.py,
# tests/_tiers.py, pyproject.toml, scripts/, .ci/) changed.
set -uo pipefail
cd "$(dirname "$0")/.."
ALL="distributed sandbox_attacks kernels verl"
if [ -n "${AGENTRL_CI_TIERS:-}" ]; then
  [ "$AGENTRL_CI_TIERS" = all ] && printf '%s\n' $ALL || printf '%s\n' $AGENTRL_CI_TIERS
  exit 0
fi
n="${AGENTRL_CI_DIFF_COMMITS:-10}"
if ! changed=$(git diff --name-only "HEAD~$n" HEAD 2>/dev/null); then
  printf '%s\n' $ALL
  exit 0
fi
declare -A paths=(
  [distributed]='^agentrl/(train|models|kernels)/|^agentrl/cli|^tests/(_algos_ranks_worker|_fsdp2_[a-z_]*|_ulysses_worker|_tiny_update|_torchrun|test_torchrun_launcher|test_distributed_fsdp2|test_checkpoint_portability|test_algos_ranks|test_verl_ulysses|test_models_lora|test_train_lora)\.py$'
  [sandbox_attacks]='^agentrl/envs/sandbox/|^tests/test_sandbox_'
  [verl]='^agentrl/(train|envs|episodes|engines|harmony|models)/|^tests/(_scripted_engine|test_verl_[a-z_]*)\.py$'
  [kernels]='^agentrl/kernels/|^agentrl/engines/|^tests/(_triton_device|test_kernels_[a-z_]*|test_engine_kernels)\.py$'
)
machinery='^(tests/conftest\.py|tests/_tiers\.py|pyproject\.toml|scripts/|\.ci/)'
for tier in $ALL; do
  if grep -Eq "${paths[$tier]}|$machinery" <<<"$changed"; then echo "$tier"; fi
done
exit 0
