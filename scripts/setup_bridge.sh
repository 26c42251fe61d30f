#!/usr/bin/env bash
# Build .venv-bridge: Megatron-Bridge 0.6.2 on megatron-core 0.18.2 in its own venv (our megatron-core
# is 0.16; the bridge pins transformers 5.8-5.12 and pulls CUDA kernels, wandb, mlflow...), for the
# tests whose checkpoints the bridge itself writes (merge_pipeline_samples/megatron_bridge_save.py).
# Both wheels declare Python 3.12 and run on 3.11: megatron-core's cp312 wheel is installed under a
# cp311 name (its one compiled module, the dataset index helpers, is never loaded when saving) and
# Python 3.12's typing.override, which the bridge imports, comes from typing_extensions (a .pth shim).
# Only what its model provider, save_hf_weights and export_hf_weights import is installed, without
# their declared dependencies: triton (megatron-core's MoE stash), nvidia-modelopt (save_hf_weights'
# quantization check) with its own imports, and flash-linear-attention's core (fla-core, Triton kernels in pure
# Python: it imports on CPU), without which megatron-core's Gated DeltaNet layer (Qwen3-Next, Qwen3.5) refuses to be
# built; saving runs none of its kernels. TransformerEngine is not installed: a CPU stand-in for the modules
# megatron-core wraps (merge_pipeline_samples/te_stand_in/transformer_engine, its docstring says what and how it
# was checked) is copied into the venv's site-packages on every run, so the bridges' own TE layer specs build.
# A second run only copies the stand-in again: the stamp file records what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/isolated_venv.sh
VENV=.venv-bridge
BASE="torch==2.13.0 transformers==5.12.1 safetensors numpy einops packaging typing_extensions omegaconf==2.4.0 psutil requests pulp scipy"
BRIDGE=megatron-bridge==0.6.2
NODEPS="nvidia-modelopt==0.47.0 triton==3.9.0 fla-core==0.6.0"
CORE=megatron-core==0.18.2
PACKAGES="$BASE $CORE $BRIDGE $NODEPS"
# A CPU stand-in (its docstring says what it stands in and how it was checked) copied into the venv's site-packages:
# TransformerEngine's modules megatron-core wraps (merge_pipeline_samples/te_stand_in) and what megatron-core's Mamba
# mixer imports from mamba-ssm (merge_pipeline_samples/mamba_stand_in), so the bridges' own specs build on CPU.
install_stand_in() {
    local site
    site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    rm -rf "${site:?}/$2"
    cp -r "merge_pipeline_samples/$1/$2" "$site/"
    find "$site/$2" -name __pycache__ -prune -exec rm -rf {} +
}
install_stand_ins() {
    install_stand_in te_stand_in transformer_engine
    install_stand_in mamba_stand_in mamba_ssm
}
if venv_is_current "$VENV" "$PACKAGES"; then
    install_stand_ins
    exit 0
fi
new_venv "$VENV"
# torch first, pinned: on this CPU machine pip's find-links hold that CPU wheel on local disk.
# shellcheck disable=SC2086
venv_install "$VENV" $BASE
WHEELS=$(mktemp -d)
trap 'rm -rf "$WHEELS"' EXIT
"$VENV/bin/python" -m pip download --quiet --no-deps --python-version 3.12 --only-binary=:all: -d "$WHEELS" "$CORE"
for wheel in "$WHEELS"/megatron_core-*-cp312-cp312-*.whl; do
    mv "$wheel" "${wheel//cp312-cp312/cp311-cp311}"
done
# shellcheck disable=SC2086
venv_install "$VENV" --no-deps $NODEPS
# pip: uv has no --ignore-requires-python for the two that declare Python 3.12.
"$VENV/bin/python" -m pip install --quiet --no-deps --ignore-requires-python "$WHEELS"/megatron_core-*.whl "$BRIDGE"
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cat > "$SITE/_py312_shims.py" <<'PY'
"""Python 3.12 names that Megatron-Bridge imports, for its install on 3.11."""
import typing

import typing_extensions

if not hasattr(typing, "override"):
    typing.override = typing_extensions.override
PY
echo "import _py312_shims" > "$SITE/_py312_shims.pth"
install_stand_ins
"$VENV/bin/python" -c "import typing; typing.override; import megatron.core, modelopt.torch.quantization.utils
from megatron.core.ssm.gated_delta_net import HAVE_FLA; assert HAVE_FLA"
echo "$PACKAGES" > "$VENV/stamp"
