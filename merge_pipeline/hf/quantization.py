"""``--quantize SCHEME``: the compressed-tensors formats (``quant_method: compressed-tensors``) that need no
calibration data, as llm-compressor's ``model_free_ptq`` writes them: which presets, which weights are
quantized and which kept, and config.json's ``quantization_config``.

The weights a scheme quantizes are the ones ``model_free_ptq`` does for the same ``ignore`` list: every
2-D floating ``<module>.weight`` whose module does not end in ``norm`` and matches no ``ignore`` entry
(a module name, or ``re:PATTERN`` matched from the name's start: compressed-tensors' ``match_name``).
By default ``ignore`` names what the architecture keeps in high precision (embeddings, heads, MoE routers,
vision and audio towers: the rule ``--dtype fp8`` keeps, ``hf/fp8.py``); weights whose shape does not fit
the scheme's groups are added to it, so config.json tells loaders the truth.

compressed-tensors (the ``[quant]`` extra) is imported only when a scheme is used.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from merge_pipeline.errors import MergeError
from merge_pipeline.hf.fp8 import _KEPT_NAMES, _tower
from merge_pipeline.plan import PlannedTensor

# The data-free presets written byte for byte as model_free_ptq writes them (checked by the tests).
SCHEMES = ("W4A16", "W4A16_ASYM", "W8A16", "FP8_DYNAMIC", "FP8_BLOCK", "NVFP4A16", "MXFP4A16", "MXFP8A16")
# Calibrated presets and the data-free preset of the same weight format.
_DATA_FREE_INSTEAD = {"NVFP4": "NVFP4A16", "FP8": "FP8_DYNAMIC", "MXFP4": "MXFP4A16", "MXFP8": "MXFP8A16"}
_INSTALL = "pip install 'merge-pipeline[quant]'"
# Said of a folder whose zero points are packed (the closing line, the model card, the step report): llm-compressor's
# own folders of these schemes fail in transformers the same way.
_PACKED_ZERO_POINTS = "transformers 5.25, which builds the packed zero points unpacked (vLLM and SGLang load them)"


def preset(name: str, where: Path | None = None):
    """compressed-tensors' ``QuantizationScheme`` of a supported preset; anything else refused in one line."""
    name = name.upper()
    try:
        from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES, preset_name_to_scheme
    except ImportError:
        raise MergeError(where, f"--quantize needs the compressed-tensors library: {_INSTALL}") from None
    if name not in PRESET_SCHEMES:
        raise MergeError(
            where, f"--quantize {name}: no compressed-tensors preset of that name; one of {', '.join(SCHEMES)}"
        )
    activations = PRESET_SCHEMES[name].get("input_activations")
    if activations is not None and activations.dynamic is not True:
        instead = _DATA_FREE_INSTEAD.get(name, "W4A16")
        raise MergeError(
            where,
            f"--quantize {name} quantizes activations with scales calibrated on data, which a merge has none of:"
            f" use {instead} (its weights, activations left in 16 bits)",
        )
    if name not in SCHEMES:
        raise MergeError(where, f"--quantize {name} is not yet supported: one of {', '.join(SCHEMES)}")
    scheme = preset_name_to_scheme(name, ["Linear"])  # model_free_ptq's target when a preset names none
    if scheme.weights.observer in ("minmax", "mse"):  # what model_free_ptq runs instead (memoryless per weight)
        scheme.weights.observer = f"static_{scheme.weights.observer}"
    return scheme


def matches(module: str, entry: str) -> bool:
    """compressed-tensors' ``match_name``: ``re:PATTERN`` matched from the start, anything else the exact name."""
    if entry.startswith("re:"):
        return re.match(entry.removeprefix("re:"), module) is not None
    return module == entry


@dataclass
class QuantDecisions:
    """What ``--quantize`` quantizes and keeps: config.json, ``inspect``, the manifest and the model card."""

    scheme_name: str
    scheme: object  # compressed_tensors.quantization.QuantizationScheme
    ignore: list[str]  # config.json's ignore: the defaults or the user's, and the off-grid modules
    quantized: list[str] = field(default_factory=list)  # weight names
    off_grid: list[str] = field(default_factory=list)  # weights kept: their shape does not fit the groups
    format: str = ""  # compressed-tensors' compression format of the quantized weights

    @property
    def quantization_config(self) -> dict:
        """config.json's ``quantization_config``, as llm-compressor writes it (its version is the library's)."""
        from compressed_tensors import __version__
        from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

        config = QuantizationConfig(
            config_groups={self.scheme_name: self.scheme},
            ignore=list(self.ignore),
            quantization_status=QuantizationStatus.COMPRESSED,
            format=self.format,
        )
        return {
            "version": __version__,
            "quant_method": "compressed-tensors",
            "transform_config": {},
            **config.model_dump(),
        }

    def summary(self) -> dict:
        return {
            "scheme": self.scheme_name,
            "format": self.format,
            "quantized_weights": len(self.quantized),
            "ignore": self.ignore,
            "off_grid": self.off_grid,
            **({"not_loaded_by": _PACKED_ZERO_POINTS} if zero_point_packing(self.quantization_config) else {}),
        }


def zero_point_packing(quantization_config: dict) -> int | None:
    """How many zero points compressed-tensors packs into one int32 down the rows, for a config with an asymmetric
    ``pack-quantized`` group (``W4A16_ASYM``, or a base's own); None for any other. vLLM and SGLang read them
    packed; transformers 5.25 builds them unpacked, one per row."""
    if quantization_config.get("quant_method") != "compressed-tensors":
        return None
    for group in quantization_config.get("config_groups", {}).values():
        weights = group.get("weights") or {}
        packed = (group.get("format") or quantization_config.get("format")) == "pack-quantized"
        if packed and weights.get("symmetric") is False:
            return 32 // weights["num_bits"]
    return None


def decide(
    tensors: list[PlannedTensor], name: str, ignore: tuple[str, ...], where: Path, scheme=None
) -> QuantDecisions:
    """Which weights ``name`` quantizes, from their names and shapes alone: the one place this is decided.
    ``scheme``: a config group of the base's own, named ``name`` (``--quantize as-base``), not a preset."""
    from merge_pipeline.hf.fp8 import refuse_quantized

    if scheme is None:
        name, scheme = name.upper(), preset(name, where)
    refuse_quantized(tensors, where)
    entries = list(ignore) if ignore else default_ignore(tensors)
    decisions = QuantDecisions(name, scheme, entries)
    for t in tensors:
        module, _, param = t.name.rpartition(".")
        if param != "weight" or module.endswith("norm") or any(matches(module, e) for e in entries):
            continue
        if len(t.shape) == 3 and module.endswith(("gate_up_proj", "down_proj")):
            raise MergeError(
                where, f"{t.name}: experts stored as one {len(t.shape)}-D tensor are not yet supported by --quantize"
            )
        if len(t.shape) != 2 or not t.dtype.is_floating_point or not _fits(t.shape, scheme.weights):
            decisions.ignore.append(module)
            if len(t.shape) == 2:
                decisions.off_grid.append(t.name)
            continue
        decisions.quantized.append(t.name)
    return decisions


def default_ignore(tensors: list[PlannedTensor]) -> list[str]:
    """The modules the architecture keeps in high precision: towers by a pattern, the rest by name."""
    towers: dict[str, None] = {}
    kept: list[str] = []
    for t in tensors:
        if len(t.shape) != 2 or not t.name.endswith(".weight"):
            continue
        module = t.name.removesuffix(".weight")
        tower = _tower(module)
        if tower:
            towers[f"re:{re.escape(tower)}\\."] = None
        elif _KEPT_NAMES.search(t.name):
            kept.append(module)
    return [*towers, *sorted(kept)]


def _fits(shape: tuple[int, ...], weights) -> bool:
    """A weight the scheme's groups tile: its columns a multiple of the group size (block schemes pad rows and columns)."""
    if weights.group_size:
        return shape[1] % weights.group_size == 0
    return True
