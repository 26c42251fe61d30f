#!/usr/bin/env bash
# The whole test suite, on a fresh machine or an existing checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
