"""The FP8 Hugging Face format (DeepSeek-V3 / Qwen3-FP8, ``quant_method: fp8``): which weights it quantizes,
its ``quantization_config``, and how a loader reads a quantized weight back.

Each quantized ``<module>.weight`` is ``float8_e4m3fn``, with ``<module>.weight_scale_inv``: one fp32 per
``block x block`` tile, and ``weight ~= fp8.float() * scale_inv`` (transformers' ``Fp8Dequantize``, vLLM,
SGLang). Everything else stays in higher precision and is named in ``modules_to_not_convert``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from merge_pipeline.errors import MergeError
from merge_pipeline.plan import PlannedTensor

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
SCALE_DTYPE = torch.float32
KEPT_DTYPE = torch.bfloat16  # what FP8 releases keep their embeddings, norms and heads in
SCALE_SUFFIX = "_scale_inv"

# 2-D weights that are no linear layer of the decoder, or that FP8 releases and loaders keep in high
# precision: embeddings, LM / value heads, MoE routers (transformers' routers are no nn.Linear; vLLM
# reads them unquantized), DeepSeek-V3 MTP's eh_proj (vLLM builds it as a plain nn.Linear).
_KEPT_NAMES = re.compile(
    r"(^|\.)(embed_tokens|embed_in|wte|wpe|word_embeddings|embed_positions|position_embeddings"
    r"|lm_head|score|head|gate|router|shared_expert_gate|eh_proj)\.weight$"
)
# Modules whose whole subtree stays in high precision: vision / audio towers and their projectors.
_KEPT_TOWERS = ("visual", "vision_tower", "vision_model", "multi_modal_projector", "audio_tower")


@dataclass
class Fp8Decisions:
    """What ``--dtype fp8`` quantizes and keeps: config.json's ``quantization_config``, ``inspect`` and the manifest."""

    block: int
    quantized: list[str] = field(default_factory=list)  # weight names
    kept: list[str] = field(default_factory=list)  # module names (towers by prefix) left unquantized
    off_grid: list[str] = field(default_factory=list)  # linear weights kept because a dim is no multiple of block

    @property
    def quantization_config(self) -> dict:
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [self.block, self.block],
            "modules_to_not_convert": self.kept,
        }

    def summary(self) -> dict:
        return {
            "block": self.block,
            "quantized_weights": len(self.quantized),
            "kept_modules": self.kept,
            "off_grid": self.off_grid,
        }


def decide_fp8(tensors: list[PlannedTensor], block: int, where: Path) -> Fp8Decisions:
    """Which weights are quantized, from their names and shapes alone: the one place this is decided."""
    refuse_quantized(tensors, where)
    decisions = Fp8Decisions(block)
    towers: dict[str, None] = {}
    for t in tensors:
        if len(t.shape) != 2 or not t.name.endswith(".weight") or not t.dtype.is_floating_point:
            continue  # norms, biases, convolutions, buffers
        module = t.name.removesuffix(".weight")
        tower = _tower(module)
        if tower:
            towers[tower] = None
        elif _KEPT_NAMES.search(t.name):
            decisions.kept.append(module)
        elif t.shape[0] % block or t.shape[1] % block:
            decisions.kept.append(module)
            decisions.off_grid.append(t.name)
        else:
            decisions.quantized.append(t.name)
    decisions.kept = sorted([*towers, *decisions.kept])  # the same list whatever order the reader planned
    return decisions


def refuse_quantized(tensors: list[PlannedTensor], where: Path) -> None:
    """FP8 weights are not quantized again: one line naming the first."""
    for t in tensors:
        if t.dtype in (FP8, torch.float8_e5m2) or t.name.endswith(SCALE_SUFFIX):
            raise MergeError(where, f"{t.name} is already quantized: --dtype fp8 takes unquantized weights")


def _tower(module: str) -> str | None:
    parts = module.split(".")
    for index, part in enumerate(parts):
        if part in _KEPT_TOWERS:
            return ".".join(parts[: index + 1])
    return None


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: int) -> torch.Tensor:
    """fp32 ``weight * scale_inv`` per tile: what the FP8 loaders compute."""
    rows, cols = weight.shape
    tiles = weight.to(torch.float32).view(rows // block, block, cols // block, block)
    return (tiles * scale_inv[:, None, :, None]).view(rows, cols)
