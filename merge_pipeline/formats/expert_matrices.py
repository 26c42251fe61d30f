"""Grouped experts in Hugging Face's transposed layout, streamed one expert's matrix at a time.

gpt-oss keeps each layer's experts as one tensor per kind, each expert's matrix stored as
``x @ W`` multiplies it (``gate_up_proj`` [E, hidden, 2 x ffn], ``down_proj`` [E, ffn, hidden]), with
gate and up interleaved along the last dimension (gate ``j`` at column ``2j``, up ``j`` at ``2j + 1``).
Megatron-Core and torchtitan store the same matrix as a Linear weight [out, in], so the HF tensor is
the transpose of each stored matrix, its rows first interleaved when they hold [gate; up] in two halves
(Megatron-Core's fused fc1). Neither is a selection of stored rows: the stored tensor is read in its
own order and each whole expert matrix is rearranged in memory as it passes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from merge_pipeline.plan import TensorSource, regrouped


@dataclass(frozen=True)
class ExpertMatrices:
    stored: TensorSource  # the experts' stored matrices, one after the other, in row-major order
    shape: tuple[int, ...]  # of the stored rows: [experts x rows, *columns]
    dtype: torch.dtype
    experts: int
    interleave_halves: bool  # rows [gate; up] -> gate 0, up 0, gate 1, up 1, ...
    transpose: bool  # [rows, columns] -> [columns, rows] (a 1-D bias stays as it is)

    def byte_runs(self) -> None:
        return None

    def pieces(self) -> Iterator[torch.Tensor]:
        rows, columns = self.shape[0] // self.experts, self.shape[1:]
        matrix = torch.empty((rows, *columns), dtype=self.dtype)
        for _ in regrouped(self.stored.pieces(), matrix.view(-1)):
            yield self._hf_layout(matrix)

    def _hf_layout(self, matrix: torch.Tensor) -> torch.Tensor:
        if self.interleave_halves:
            halves = matrix.view(2, matrix.shape[0] // 2, *matrix.shape[1:])
            matrix = halves.transpose(0, 1).reshape(matrix.shape)
        if self.transpose and matrix.dim() == 2:
            matrix = matrix.t()
        return matrix.contiguous().reshape(-1)


def hf_shape(shape: tuple[int, ...], experts: int, transpose: bool) -> tuple[int, ...]:
    """The HF tensor's shape: [experts, one expert's matrix as HF keeps it]."""
    rows, columns = shape[0] // experts, shape[1:]
    return (experts, *columns, rows) if transpose and len(columns) == 1 else (experts, rows, *columns)
