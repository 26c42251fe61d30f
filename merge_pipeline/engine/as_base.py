"""``--quantize as-base``: the base model's own ``quantization_config``, written as the base ships it.

The base's config is ``--hf_model_path``'s config.json when given (the model the trainer started from), else
the checkpoint's own. A compressed-tensors config is written from its own config group, named as the base names
it, with its ``ignore`` list: what llm-compressor's ``model_free_ptq`` writes given that config, when the group
quantizes weights as one of our presets does (the same bits, type, strategy, symmetry, activations and format;
its own group size or block). ``quant_method: fp8`` with a square ``weight_block_size`` becomes ``--dtype fp8``
with that block; gpt-oss's ``mxfp4`` has a writer of its own. Anything else is refused in one line naming what
we would not reproduce: a folder claiming the base's format must be in it.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

from merge_pipeline.engine.quantize import BAND_ROWS
from merge_pipeline.errors import MergeError
from merge_pipeline.files.json_files import read_json_object
from merge_pipeline.hf.config import ModelConfig
from merge_pipeline.hf.quantization import SCHEMES, preset
from merge_pipeline.options import AS_BASE, MergeOptions

# The fields of the weights' QuantizationArgs that must equal a preset's for our writer to write its bytes
# (group size and block are the base's own; observers only pick scales at calibration: model_free_ptq takes
# min-max whatever the config names).
_WEIGHT_FIELDS = ("num_bits", "type", "symmetric", "strategy", "dynamic", "actorder")


def following_base(options: MergeOptions, config: ModelConfig) -> MergeOptions:
    """``options`` with an FP8-block base's ``--quantize as-base`` as ``--dtype fp8`` with its block; any other
    base checked now (refused before any work) and left ``as-base``, for ``weight_format.formatted_outputs``."""
    if not follows_base(options):
        return options
    path, base = base_quantization(options, config)
    method = base.get("quant_method")
    if method == "fp8":
        return replace(options, quantize=None, quantize_ignore=(), dtype="fp8", fp8_block_size=_fp8_block(base, path))
    if method == "compressed-tensors":
        base_scheme(base, path)
        return options
    if method == "mxfp4":
        return options
    raise MergeError(
        path,
        f"--quantize {AS_BASE}: the base's quant_method {method!r} is not written by this tool"
        " (compressed-tensors presets, fp8 blocks and gpt-oss's mxfp4 are)",
    )


def follows_base(options: MergeOptions) -> bool:
    return options.quantize is not None and options.quantize.lower() == AS_BASE


def base_quantization(options: MergeOptions, config: ModelConfig) -> tuple[Path, dict]:
    """The config.json the base's format is read from, and its ``quantization_config``."""
    path = Path(options.hf_model_path) / "config.json" if options.hf_model_path else config.path
    raw = read_json_object(path) if options.hf_model_path else config.raw
    base = raw.get("quantization_config")
    if not base:
        raise MergeError(
            path,
            f"--quantize {AS_BASE}: the base model has no quantization_config, nothing to follow;"
            f" name a scheme instead ({', '.join(SCHEMES)}) or --dtype fp8",
        )
    return path, base


def _fp8_block(base: dict, path: Path) -> int:
    block = base.get("weight_block_size")
    if not block or len(block) != 2 or block[0] != block[1]:
        raise MergeError(
            path,
            f"--quantize {AS_BASE}: the base's fp8 weight_block_size {block!r} is not one square block"
            " (--dtype fp8 writes square blocks of scales)",
        )
    if base.get("activation_scheme", "dynamic") != "dynamic":
        raise MergeError(
            path,
            f"--quantize {AS_BASE}: the base's fp8 activation_scheme {base['activation_scheme']!r} needs scales"
            " calibrated on data, which a merge has none of",
        )
    return int(block[0])


def base_scheme(base: dict, path: Path):
    """The base's one config group (its name and QuantizationScheme), when it quantizes weights as a preset
    does; else one line naming the nearest preset and each field that differs."""
    from compressed_tensors.quantization import QuantizationScheme

    groups = base.get("config_groups") or {}
    if len(groups) != 1:
        raise MergeError(path, f"--quantize {AS_BASE}: the base has {len(groups)} config groups; one is written")
    ((name, group),) = groups.items()
    try:
        scheme = QuantizationScheme.model_validate(group)
    except ValueError as exc:
        raise MergeError(path, f"--quantize {AS_BASE}: the base's config group {name!r} is invalid: {exc}") from None
    differences = {preset_name: _differences(preset_name, scheme, base.get("format")) for preset_name in SCHEMES}
    nearest = min(SCHEMES, key=lambda preset_name: len(differences[preset_name]))
    if differences[nearest]:
        raise MergeError(
            path,
            f"--quantize {AS_BASE}: the base's config group {name!r} is written by no preset we write byte for byte;"
            f" nearest {nearest}, which differs in {'; '.join(differences[nearest])}",
        )
    block = scheme.weights.block_structure
    if block and BAND_ROWS % block[0]:
        raise MergeError(path, f"--quantize {AS_BASE}: the base's blocks of {block[0]} rows do not divide 128")
    if scheme.weights.observer in ("minmax", "mse"):  # what model_free_ptq runs instead, as for a preset
        scheme.weights.observer = f"static_{scheme.weights.observer}"
    return name, scheme


def _differences(name: str, scheme, format: str | None) -> list[str]:
    """What the base's group states that preset ``name`` writes otherwise: ``field base (preset)``."""
    ours = preset(name)
    found = [
        f"weights.{key} {getattr(scheme.weights, key)!r} ({getattr(ours.weights, key)!r})"
        for key in _WEIGHT_FIELDS
        if getattr(scheme.weights, key) != getattr(ours.weights, key)
    ]
    for key in ("input_activations", "output_activations"):
        theirs, mine = getattr(scheme, key), getattr(ours, key)
        if (theirs is None) != (mine is None) or (mine is not None and theirs.dynamic != mine.dynamic):
            found.append(f"{key} {'none' if theirs is None else 'dynamic=' + str(theirs.dynamic)}")
    if format != _format_of(name):
        found.append(f"format {format!r} ({_format_of(name)!r})")
    return found


@functools.cache
def _format_of(name: str) -> str:
    """The compression format our writer gives preset ``name``'s weights (what compress_module picks)."""
    import torch

    from merge_pipeline.engine.quantize import quantize_band

    scheme = preset(name)
    global_scale = torch.ones(1) if scheme.weights.strategy == "tensor_group" else None
    quantize_band(torch.zeros(128, 128, dtype=torch.bfloat16), scheme, global_scale)
    return str(scheme.format.value)
