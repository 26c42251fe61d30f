#!/usr/bin/env bash
# Build .venv-nemo: NeMo-Automodel 0.7.0 in its own venv (it pins transformers 5.18 and pulls CUDA
# kernels, datasets and mistral-common, which clash with ours), for the tests whose checkpoints
# NeMo-Automodel itself writes (merge_pipeline_samples/nemo_automodel_save.py). Only what its
# Checkpointer's save path imports is installed: torch (CPU), transformers and pyyaml, then
# nemo-automodel without its declared dependencies.
# A second run is a no-op: the stamp file records what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/isolated_venv.sh
VENV=.venv-nemo
PACKAGES="torch==2.13.0 transformers==5.18.0 pyyaml safetensors numpy nemo-automodel==0.7.0"
if venv_is_current "$VENV" "$PACKAGES"; then
    exit 0
fi
new_venv "$VENV"
# torch first, pinned: on this CPU machine pip's find-links (uv_options.py) hold that CPU wheel on local disk.
venv_install "$VENV" torch==2.13.0 transformers==5.18.0 pyyaml safetensors numpy
# Last, so that no later pip run reports nemo-automodel's declared dependencies as missing.
venv_install "$VENV" --no-deps nemo-automodel==0.7.0
"$VENV/bin/python" -c "import nemo_automodel.components.checkpoint.checkpointing"
echo "$PACKAGES" > "$VENV/stamp"
