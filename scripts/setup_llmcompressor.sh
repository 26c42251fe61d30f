#!/usr/bin/env bash
# Build .venv-llmcompressor: llm-compressor 0.14.0.1 (on compressed-tensors 0.19.0) in its own venv (it pins
# transformers 5.15-5.17; ours is 5.25), the reference the quantized merges are compared with byte for byte
# (its model_free_ptq on a bf16 merge of the same checkpoint). A second run does nothing: the stamp records
# what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/isolated_venv.sh
VENV=.venv-llmcompressor
TORCH=torch==2.13.0
PACKAGES="$TORCH llmcompressor==0.14.0.1 compressed-tensors==0.19.0"
if venv_is_current "$VENV" "$PACKAGES"; then
    exit 0
fi
new_venv "$VENV"
# torch first, pinned: on this CPU machine pip's find-links (uv_options.py) hold that CPU wheel on local disk.
venv_install "$VENV" "$TORCH"
# shellcheck disable=SC2086
venv_install "$VENV" $PACKAGES
"$VENV/bin/python" -c "from llmcompressor import model_free_ptq"
echo "$PACKAGES" > "$VENV/stamp"
