"""torchtitan's q/k rows back in Hugging Face's rotary order, streamed a block of heads at a time.

torchtitan's llama3 adapter (``_permute`` in ``from_hf``) keeps each attention head's rows as
(half, 2), HF as (2, half): HF row ``b * half + a`` of a head is its stored row ``2 * a + b``. So
each output row is one stored row, but planning them as one file range per row made the plan grow
with rows x saved chunks (every row looked up among every chunk: a million lookups for one q_proj
saved by 1024 ranks). Here the stored tensor is read in its own order, as its chunks' byte runs,
and each block of whole heads is permuted in memory as it passes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from merge_pipeline.plan import TensorSource, regrouped

# Two blocks are held (read, permuted): small, since the stored tensor's own reads keep a buffer too.
_BLOCK_BYTES = 1 << 20


@dataclass(frozen=True)
class RotaryRows:
    stored: TensorSource  # the stored tensor's elements in its row-major order
    shape: tuple[int, ...]
    dtype: torch.dtype
    heads: int  # the row count is a multiple of 2 x heads

    def byte_runs(self) -> None:
        return None

    def pieces(self) -> Iterator[torch.Tensor]:
        head = self.shape[0] // self.heads * math.prod(self.shape[1:])  # elements per head
        block = torch.empty(
            max(1, min(self.heads, _BLOCK_BYTES // max(head * self.dtype.itemsize, 1))) * head, dtype=self.dtype
        )
        out = torch.empty_like(block)
        for n in regrouped(self.stored.pieces(), block):
            yield self._hf_order(block, out, n)

    def _hf_order(self, block: torch.Tensor, out: torch.Tensor, n: int) -> torch.Tensor:
        heads = n * self.heads // (self.shape[0] * math.prod(self.shape[1:]))
        half = self.shape[0] // self.heads // 2
        out[:n].view(heads, 2, half, -1).copy_(block[:n].view(heads, half, 2, -1).transpose(1, 2))
        return out[:n]
