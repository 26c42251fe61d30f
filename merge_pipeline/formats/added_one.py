"""A stored tensor plus one, streamed: a zero-centred norm weight as the standard norm's weight.

megatron-core's ``layernorm_zero_centered_gamma`` keeps ``weight - 1``; where the HF model's norm multiplies by
``weight`` itself (Qwen3-Next's gated out norm), Megatron-Bridge's export adds one to the tensor in its own dtype
(``RMSNorm2ZeroCenteredRMSNormMapping``). The same addition here, piece by piece, gives the same bits.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from merge_pipeline.plan import TensorSource


@dataclass(frozen=True)
class AddedOne:
    stored: TensorSource

    def byte_runs(self) -> None:
        return None

    def pieces(self) -> Iterator[torch.Tensor]:
        for piece in self.stored.pieces():
            yield piece + 1
