"""``--dtype fp8``: linear weights block-quantized to FP8 on their way to disk (DeepSeek-V3 / Qwen3-FP8 layout).

Each quantized ``<module>.weight`` is written as ``float8_e4m3fn`` and followed, in the same shard,
by ``<module>.weight_scale_inv``: one fp32 per ``block x block`` tile, such that
``weight ~= fp8.float() * scale_inv`` (what transformers' ``Fp8Dequantize``, vLLM and SGLang do on
load). Everything else is kept in higher precision (bfloat16) and named in config.json's
``quantization_config.modules_to_not_convert``.

The scale rule is transformers' own FP8 quantizer (``Fp8Quantize._quantize_one`` in
``transformers/integrations/finegrained_fp8.py``, the reverse of its loader): per tile
``scale = 448 / amax``, ``scale_inv = 1 / scale`` in fp32, ``fp8 = clamp(x * scale, -448, 448)``
cast with round-to-nearest-even; an all-zero tile gets ``scale = scale_inv = 1``. One deviation,
where that rule would write NaN: a tile whose amax is so small that ``448 / amax`` overflows is
treated as a zero tile (its values are below FP8's range: they dequantize to zero either way).

The weight is quantized as its rows arrive, in bands of ``block`` rows: memory holds one read piece's
worth of bands (at least one band), never the tensor (unless the source itself builds the whole
tensor, e.g. a LoRA merge).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import torch

from merge_pipeline.engine.outputs import KeptFromPass, Quantized
from merge_pipeline.engine.safetensors_writer import OutputTensor
from merge_pipeline.errors import MergeError
from merge_pipeline.hf.fp8 import FP8, FP8_MAX, SCALE_DTYPE, SCALE_SUFFIX, Fp8Decisions, decide_fp8
from merge_pipeline.plan import READ_PIECE_BYTES, PlannedTensor


def fp8_quantizer(model: list[PlannedTensor], block: int, where: Path) -> tuple[Fp8Decisions, Quantized]:
    """What ``model`` quantizes to FP8, and the writer of each such weight and its scales."""
    decisions = decide_fp8(model, block, where)
    if not decisions.quantized:
        raise MergeError(where, nothing_to_quantize(decisions, {t.name: t.shape for t in model}))
    quantized = set(decisions.quantized)

    def pair(weight: PlannedTensor):
        if weight.name not in quantized:
            return None
        weight, scales = quantized_pair(weight, block)
        return weight, (scales,)

    return decisions, pair


def nothing_to_quantize(decisions: Fp8Decisions, shapes: dict[str, tuple[int, ...]]) -> str:
    """Why ``--dtype fp8`` would write no FP8 weight, and what to pass instead. Such a folder would still
    carry a ``quantization_config``, and loaders would treat a bfloat16 model as an FP8 one."""
    block = decisions.block
    if not decisions.off_grid:
        return (
            "--dtype fp8 would quantize nothing: no weight here is a linear layer FP8 releases quantize"
            f" (the {len(decisions.kept)} 2-D weights are embeddings, heads, routers or vision towers);"
            " pass another --dtype (e.g. bfloat16)"
        )
    dims = [d for name in decisions.off_grid for d in shapes[name]]
    fitting = math.gcd(*dims) & -math.gcd(*dims)  # the largest power of two dividing every one of their dimensions
    first = decisions.off_grid[0]
    instead = f"--fp8-block-size {fitting} (it divides all their dimensions) or " if fitting > 1 else ""
    return (
        f"--dtype fp8 would quantize nothing: none of the {len(decisions.off_grid)} linear weights lies on the"
        f" {block}x{block} block grid (both dimensions multiples of {block}; {first} is"
        f" {'x'.join(map(str, shapes[first]))}), and the folder would claim FP8 with every weight in bfloat16;"
        f" pass {instead}another --dtype (e.g. bfloat16)"
    )


def quantized_pair(weight: PlannedTensor, block: int) -> tuple[OutputTensor, OutputTensor]:
    """The FP8 weight and its ``weight_scale_inv``, both computed in one pass over the source rows."""
    source = _Fp8Bands(weight, block)
    rows, cols = weight.shape
    grid = (rows // block, cols // block)
    return (
        OutputTensor(PlannedTensor(weight.name, weight.shape, FP8, source), FP8),
        OutputTensor(
            PlannedTensor(weight.name + SCALE_SUFFIX, grid, SCALE_DTYPE, KeptFromPass(source, source.take_scales)),
            SCALE_DTYPE,
        ),
    )


def quantize_bands(bands: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 values and fp32 ``scale_inv`` (one per tile) of whole bands of ``block`` rows of a weight."""
    rows, cols = bands.shape
    tiles = bands.to(torch.float32).view(rows // block, block, cols // block, block)
    amax = tiles.abs().amax(dim=(1, 3))
    if not torch.isfinite(amax).all():
        raise ValueError("holds inf or NaN")
    scale = FP8_MAX / amax
    usable = (amax > 0) & torch.isfinite(scale)  # zero tiles (and tiles below FP8's range) dequantize to zero
    scale = torch.where(usable, scale, torch.ones_like(scale))
    scale_inv = (1.0 / scale).to(SCALE_DTYPE)
    quantized = (tiles * scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return quantized.view(rows, cols), scale_inv


class _Fp8Bands:
    """A ``TensorSource`` of FP8 bytes: the source's row-major pieces gathered into bands of ``block``
    rows, quantized as they complete. The scales are kept for the ``weight_scale_inv`` that follows.

    Bands are quantized a group at a time, as many as fit in one read piece (at least one): each
    torch call then covers megabytes, since per-call overhead (thread hand-offs on a busy machine)
    would otherwise dominate narrow weights."""

    def __init__(self, weight: PlannedTensor, block: int):
        self.weight, self.block = weight, block
        self.scales: torch.Tensor | None = None

    def byte_runs(self) -> None:
        return None

    def pieces(self) -> Iterator[torch.Tensor]:
        rows, cols = self.weight.shape
        band_numel, bands = self.block * cols, rows // self.block
        per_group = max(1, min(bands, READ_PIECE_BYTES // (band_numel * SCALE_DTYPE.itemsize)))
        scales = torch.empty(bands, cols // self.block, dtype=SCALE_DTYPE)
        group: torch.Tensor | None = None  # bands gathered from pieces that end inside them
        filled = done = 0  # values in ``group``; bands quantized
        for piece in self.weight.source.pieces():
            piece = piece.reshape(-1)
            while piece.numel():
                wanted = min(per_group, bands - done) * band_numel
                if filled == 0 and piece.numel() >= wanted:  # whole bands in the piece: no copy
                    yield self._quantize(piece[:wanted], scales, done)
                    piece, done = piece[wanted:], done + wanted // band_numel
                    continue
                if group is None:
                    group = torch.empty(per_group * band_numel, dtype=self.weight.dtype)
                n = min(wanted - filled, piece.numel())
                group[filled : filled + n].copy_(piece[:n])
                filled, piece = filled + n, piece[n:]
                if filled == wanted:
                    yield self._quantize(group[:wanted], scales, done)
                    filled, done = 0, done + wanted // band_numel
        if filled or done != bands:
            raise RuntimeError(f"{self.weight.name}: source gave {done * band_numel + filled} of {rows * cols} values")
        self.scales = scales

    def take_scales(self) -> torch.Tensor | None:
        """The ``weight_scale_inv`` the last pass kept, once (``None`` before a pass)."""
        scales, self.scales = self.scales, None
        return scales

    def _quantize(self, flat: torch.Tensor, scales: torch.Tensor, first: int) -> torch.Tensor:
        cols = self.weight.shape[1]
        try:
            quantized, tile_scales = quantize_bands(flat.view(-1, cols), self.block)
        except ValueError as exc:
            raise MergeError(None, f"{self.weight.name} {exc}: it cannot be quantized to FP8") from None
        scales[first : first + len(tile_scales)] = tile_scales
        return quantized
