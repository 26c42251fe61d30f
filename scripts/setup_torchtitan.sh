#!/usr/bin/env bash
# Build .venv-torchtitan: torchtitan 0.3.0 in its own venv (its dependencies -- huggingface_hub 1.x,
# wandb, datasets -- clash with ours), for the tests whose checkpoints torchtitan itself writes
# (merge_pipeline_samples/torchtitan_save.py). Only what its model, fully_shard and
# CheckpointManager save path import is installed: torchtitan, spmd_types and triton (imported by its
# MoE token dispatcher even on CPU) without their declared dependencies, which would pull a CUDA torch.
# A second run is a no-op: the stamp file records what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/isolated_venv.sh
VENV=.venv-torchtitan
PACKAGES="torch==2.13.0 torchtitan==0.3.0 spmd_types==0.2.3 triton==3.9.0 tyro numpy safetensors einops"
if venv_is_current "$VENV" "$PACKAGES"; then
    exit 0
fi
new_venv "$VENV"
# torch first, pinned: on this CPU machine pip's find-links (uv_options.py) hold that CPU wheel on local disk.
venv_install "$VENV" torch==2.13.0 tyro numpy safetensors einops
# Last, so that no later pip run reports torchtitan's declared dependencies as missing.
venv_install "$VENV" --no-deps torchtitan==0.3.0 spmd_types==0.2.3 triton==3.9.0
"$VENV/bin/python" -c "import torchtitan.models.llama3, torchtitan.components.checkpoint"
echo "$PACKAGES" > "$VENV/stamp"
