#!/usr/bin/env bash
# Create .venv and install the project with its test extras (which pull the megatron and bench extras:
# everything the tests, the demo and the benchmarks need). Idempotent; safe to re-run. The venvs of the
# libraries that write some test fixtures in isolation are scripts/test.sh's, not the demo's.
# torch first, pinned here and not in pyproject.toml (a range there, so that an environment's own torch
# stays): on this CPU machine pip's find-links hold the 2.13.0 CPU wheel on local disk, and the project's torch
# range then installs no other. Without torch installed first, the range pulls PyPI's newest CUDA build (several
# GB). Elsewhere the CPU build comes from `pip install torch --index-url https://download.pytorch.org/whl/cpu`.
# Everything else comes at the newest release its range admits (scripts/setup_lowest.sh tests the oldest).
# uv installs (scripts/isolated_venv.sh says why); pip installs uv itself, pinned, into .venv, where the
# other setup scripts find it.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/isolated_venv.sh
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip uv==0.13.10
venv_install .venv torch==2.13.0
venv_install .venv -e ".[test]"
