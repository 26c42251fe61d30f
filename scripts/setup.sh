#!/usr/bin/env bash
# Create .venv and install the project with its test extras (which pull the megatron and bench extras:
# everything the tests, the demo and the benchmarks need). Idempotent; safe to re-run. The venvs of the
# libraries that write some test fixtures in isolation are scripts/test.sh's, not the demo's.
# torch is pinned to 2.13.0 in pyproject.toml: on this CPU machine pip takes that CPU wheel from
# local disk, where a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[test]"
