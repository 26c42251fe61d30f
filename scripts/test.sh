#!/usr/bin/env bash
# The whole test suite, on a fresh machine or an existing checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Libraries whose own save code writes test fixtures, each in its own venv (their dependencies clash
# with ours); each script is a no-op once its venv is current.
for library in torchtitan nemo bridge llmcompressor; do
    bash "scripts/setup_$library.sh"
done
exec .venv/bin/python -m pytest "$@"
