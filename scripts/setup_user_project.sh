#!/usr/bin/env bash
# Build .venv-user-project: the venv of a Dagster project that `create-dagster project` makes today, for
# merge_pipeline_tests/dagster/test_user_project.py, which installs this package into it as a user does. Here:
# the CPU torch first (docs/DAGSTER.md, "Install"), then a scaffolded project's own dependencies (its exact
# dagster pin) and this package's with its [s3] and [ray] extras, so that the test downloads nothing; this
# package itself is uninstalled again: the test installs it. create-dagster lies in a venv of its own inside,
# kept apart as `uvx create-dagster` keeps it. A second run is a no-op: the stamp records what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/isolated_venv.sh
VENV=.venv-user-project
PACKAGES="torch==2.13.0 create-dagster==1.13.29 merge_pipeline[s3,ray]"
if venv_is_current "$VENV" "$PACKAGES"; then
    exit 0
fi
new_venv "$VENV"
new_venv "$VENV/create-dagster"
venv_install "$VENV/create-dagster" create-dagster==1.13.29
venv_install "$VENV" torch==2.13.0
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
"$VENV/create-dagster/bin/create-dagster" project "$scratch/user_project" --no-uv-sync >/dev/null
venv_install "$VENV" -e "$scratch/user_project"
venv_install "$VENV" ".[s3,ray]"
"$VENV/bin/python" -m pip uninstall --quiet --yes merge_pipeline user_project
echo "$PACKAGES" > "$VENV/stamp"
