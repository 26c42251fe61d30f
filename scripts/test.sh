#!/usr/bin/env bash
# The whole test suite, on a fresh machine or an existing checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Libraries whose own save code writes test fixtures, each in its own venv (their dependencies clash
# with ours); this project at the lower bounds of its dependencies (.venv-lowest) and installed into a
# new Dagster project's venv (.venv-user-project). Each script is a no-op once its venv is current. They
# run side by side (one uv cache, locked per package, that setup.sh filled with what they share): on a fresh
# machine the downloads of one overlap the venv creation and import checks of another. The last two, one
# after the other: each builds this project in its folder (setuptools writes its egg-info there).
declare -A setups
for group in torchtitan nemo bridge llmcompressor "lowest user_project"; do
    (for library in $group; do bash "scripts/setup_$library.sh" || exit 1; done) &
    setups[$group]=$!
done
for group in "${!setups[@]}"; do
    wait "${setups[$group]}" || { echo "scripts/setup_<library>.sh failed for: $group" >&2; exit 1; }
done
exec .venv/bin/python -m pytest "$@"
