"""gpt-oss's native MXFP4 (``quant_method: mxfp4``, ``--quantize as-base`` of such a base): its MoE experts
written as the base ships them, the rest bfloat16.

Each expert tensor ``<experts>.gate_up_proj`` / ``down_proj`` (``[experts, in, out]``) becomes
``<name>_blocks`` (uint8 ``[experts, out, in / 32, 16]``: two FP4 E2M1 codes a byte, the low nibble first)
and ``<name>_scales`` (uint8 ``[experts, out, in / 32]``: E8M0, the power of two plus 127), what
transformers' ``convert_moe_packed_tensors`` turns back into ``[experts, in, out]``. The numbers are
compressed-tensors' MXFP4 (its ``MXFP4A16`` preset: groups of 32 along ``in``, its codes and exponents
packed alike), one expert at a time: memory holds one expert, never the tensor.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from merge_pipeline.engine.outputs import KeptFromPass, Quantized
from merge_pipeline.engine.quantize import QUANTIZED_FROM, quantize_band
from merge_pipeline.engine.safetensors_writer import OutputTensor
from merge_pipeline.errors import MergeError
from merge_pipeline.hf.quantization import preset
from merge_pipeline.plan import PlannedTensor

_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
_GROUP = 32  # MXFP4's block: values sharing one exponent
CODES = torch.uint8


@dataclass
class Mxfp4Decisions:
    """What gpt-oss's MXFP4 quantizes (its experts) and keeps (the base's ``modules_to_not_convert``)."""

    base_config: dict  # the base's quantization_config, written as it is
    quantized: list[str] = field(default_factory=list)
    scheme_name: str = "MXFP4"
    format: str = "experts' blocks and scales"
    off_grid: list[str] = field(default_factory=list)  # none: an off-grid expert is refused, loaders need blocks

    @property
    def ignore(self) -> list[str]:
        return list(self.base_config.get("modules_to_not_convert") or [])

    @property
    def quantization_config(self) -> dict:
        return dict(self.base_config)

    def summary(self) -> dict:
        return {
            "quant_method": "mxfp4",
            "scheme": self.scheme_name,
            "format": self.format,
            "quantized_weights": len(self.quantized),
            "ignore": self.ignore,
            "off_grid": self.off_grid,
        }


def mxfp4_quantizer(model: list[PlannedTensor], base_config: dict, where: Path) -> tuple[Mxfp4Decisions, Quantized]:
    """gpt-oss's experts in ``model``, and the writer of each one's MXFP4 blocks and scales."""
    decisions = Mxfp4Decisions(base_config)
    for t in model:
        if not _EXPERTS.search(t.name):
            continue
        if len(t.shape) != 3 or t.shape[1] % _GROUP:
            raise MergeError(
                where,
                f"{t.name} is {'x'.join(map(str, t.shape))}: MXFP4 experts need [experts, in, out], in a multiple of 32",
            )
        decisions.quantized.append(t.name)
    if not decisions.quantized:
        raise MergeError(where, "--quantize as-base: the base is MXFP4 (gpt-oss) but no gpt-oss expert tensor is here")
    quantized = set(decisions.quantized)

    def pair(weight: PlannedTensor):
        if weight.name not in quantized:
            return None
        experts, inner, outer = weight.shape
        blocks = _ExpertBlocks(weight)
        return (
            OutputTensor(PlannedTensor(f"{weight.name}_blocks", (experts, outer, inner // _GROUP, 16), CODES, blocks), CODES),
            (OutputTensor(PlannedTensor(f"{weight.name}_scales", (experts, outer, inner // _GROUP), CODES, KeptFromPass(blocks, blocks.take_scales)), CODES),),
        )  # fmt: skip

    return decisions, pair


def quantize_expert(expert: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's ``[in, out]`` weight as gpt-oss's blocks ``[out, in / 32, 16]`` and scales ``[out, in / 32]``."""
    inner, outer = expert.shape
    state = quantize_band(expert.t().contiguous(), preset("MXFP4A16"), None)
    return state["weight_packed"].view(outer, inner // _GROUP, _GROUP // 2), state["weight_scale"]


class _ExpertBlocks:
    """A ``TensorSource`` of an expert tensor's blocks: its row-major pieces gathered one expert at a time,
    each quantized as it completes; the scales are kept for the ``_scales`` written right after."""

    def __init__(self, weight: PlannedTensor):
        self.weight = weight
        self.scales: list[torch.Tensor] | None = None

    def byte_runs(self) -> None:
        return None

    def pieces(self) -> Iterator[torch.Tensor]:
        experts, inner, outer = self.weight.shape
        wanted = inner * outer
        expert, filled, scales = torch.empty(wanted, dtype=QUANTIZED_FROM), 0, []
        for piece in self.weight.source.pieces():
            piece = piece.reshape(-1)
            while piece.numel():
                n = min(wanted - filled, piece.numel())
                expert[filled : filled + n].copy_(piece[:n])
                filled, piece = filled + n, piece[n:]
                if filled == wanted:
                    blocks, expert_scales = self._quantized(expert.view(inner, outer))
                    scales.append(expert_scales)
                    yield blocks
                    filled = 0
        if filled or len(scales) != experts:
            raise RuntimeError(f"{self.weight.name}: source gave {len(scales)} of {experts} experts")
        self.scales = scales

    def take_scales(self) -> torch.Tensor | None:
        """The experts' ``_scales`` the last pass kept, once (``None`` before a pass)."""
        scales, self.scales = self.scales, None
        return None if scales is None else torch.stack(scales)

    def _quantized(self, expert: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return quantize_expert(expert)
        except ValueError as exc:
            raise MergeError(None, f"{self.weight.name} {exc}: it cannot be quantized") from None
