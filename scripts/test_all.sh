#!/usr/bin/env bash
# Every test: the default tier, every tier (distributed, sandbox_attacks, kernels, verl) and the other slow tests,
# each GPU test where a GPU is present. Extra arguments go to pytest (e.g. `-x`, `-k sandbox`).
# HYPOTHESIS_PROFILE=nightly runs the property tests with many more, random examples (tests/conftest.py).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
exec "$PY" -m pytest -q --durations=25 "$@"
