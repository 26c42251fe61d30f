"""``--quantize as-base``: the base model's own ``quantization_config``, turned into the options that write it.

The base's config is ``--hf_model_path``'s config.json when given (the model the trainer started from), else
the checkpoint's own. A compressed-tensors config becomes the preset whose scheme and format it states, with
its ``ignore`` list (one we write byte for byte as llm-compressor does); ``quant_method: fp8`` with square
``weight_block_size`` becomes ``--dtype fp8`` with that block; gpt-oss's ``mxfp4`` its own writer. Anything else is refused in one line naming
what we would not reproduce: a folder claiming the base's format must be in it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from merge_pipeline.errors import MergeError
from merge_pipeline.files.json_files import read_json_object
from merge_pipeline.hf.config import ModelConfig
from merge_pipeline.hf.quantization import SCHEMES, preset
from merge_pipeline.options import AS_BASE, MergeOptions

# The fields of a weights' QuantizationArgs that decide the bytes written (observers only pick scales at
# calibration: model_free_ptq takes min-max whatever the config names).
_WEIGHT_FIELDS = ("num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic", "actorder")


def following_base(options: MergeOptions, config: ModelConfig) -> MergeOptions:
    """``options`` with ``--quantize as-base`` replaced by what writes the base's format (else unchanged; a
    gpt-oss MXFP4 base keeps ``as-base``: ``mxfp4_quantize.py`` writes it from ``base_quantization``)."""
    if not follows_base(options):
        return options
    path, base = base_quantization(options, config)
    method = base.get("quant_method")
    if method == "compressed-tensors":
        name = _preset_of(base, path)
        return replace(options, quantize=name, quantize_ignore=options.quantize_ignore or tuple(base.get("ignore", ())))
    if method == "fp8":
        return replace(options, quantize=None, quantize_ignore=(), dtype="fp8", fp8_block_size=_fp8_block(base, path))
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


def _preset_of(base: dict, path: Path) -> str:
    """The preset whose weights and format the base's one config group states; one line naming what differs."""
    groups = base.get("config_groups") or {}
    if len(groups) != 1:
        raise MergeError(path, f"--quantize {AS_BASE}: the base has {len(groups)} config groups; one is written")
    (group,) = groups.values()
    weights = group.get("weights") or {}
    candidates = [name for name in SCHEMES if _kind(_preset_weights(name)) == _kind(weights)]
    if not candidates:
        described = ", ".join(f"{k} {weights.get(k)!r}" for k in ("num_bits", "type", "strategy"))
        raise MergeError(path, f"--quantize {AS_BASE}: no preset quantizes weights as the base does ({described})")
    differences = {}
    for name in candidates:
        differences[name] = _differences(name, group, base.get("format"))
        if not differences[name]:
            return name
    nearest = min(candidates, key=lambda name: len(differences[name]))
    raise MergeError(
        path,
        f"--quantize {AS_BASE}: the base's config is no preset written byte for byte; nearest {nearest}, which"
        f" differs in {'; '.join(differences[nearest])}",
    )


def _kind(weights: dict) -> tuple:
    return weights.get("num_bits"), weights.get("type"), weights.get("strategy")


def _preset_weights(name: str) -> dict:
    return preset(name).weights.model_dump()


def _differences(name: str, group: dict, format: str | None) -> list[str]:
    """What the base's group states that preset ``name`` writes otherwise: ``field base (preset)``."""
    scheme = preset(name)
    ours = scheme.model_dump()
    found = [
        f"weights.{key} {group['weights'].get(key)!r} ({ours['weights'][key]!r})"
        for key in _WEIGHT_FIELDS
        if group["weights"].get(key) != ours["weights"][key]
    ]
    for key in ("input_activations", "output_activations"):
        if (group.get(key) is None) != (ours[key] is None) or (
            ours[key] is not None and group[key].get("dynamic") != ours[key]["dynamic"]
        ):
            found.append(f"{key} {group.get(key)!r} ({ours[key]!r})")
    if format != _format_of(name):
        found.append(f"format {format!r} ({_format_of(name)!r})")
    return found


def _format_of(name: str) -> str:
    """The compression format our writer gives preset ``name``'s weights (what compress_module picks)."""
    import torch

    from merge_pipeline.engine.quantize import quantize_band

    scheme = preset(name)
    global_scale = torch.ones(1) if scheme.weights.strategy == "tensor_group" else None
    quantize_band(torch.zeros(128, 128, dtype=torch.bfloat16), scheme, global_scale)
    return str(scheme.format.value)
