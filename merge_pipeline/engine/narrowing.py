"""Casts to a narrower floating dtype that would turn a finite value into inf: refused, never written.

``--dtype float16`` makes inf of any value beyond 65504, ``--dtype bfloat16`` of any beyond ~3.39e38
(fp32 holds up to ~3.40e38): the merge would exit 0 with a model whose first forward pass is NaN.
The writer checks every chunk it casts to a dtype that cannot hold all of the source's finite values
(``may_overflow``); ``--dtype fp8`` quantizes with scales instead and refuses inf and NaN itself
(``engine/fp8_quantize.py``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch

from merge_pipeline.errors import MergeError
from merge_pipeline.plan import dtype_name

# Values per slice when a refused tensor is searched for its largest value: bounded memory.
_SEARCH_SLICE = 1 << 20


class OutOfRange(Exception):
    """A cast made inf or NaN of a finite value (raised by the writer, which knows the tensor)."""


def may_overflow(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether some finite ``source`` value lies beyond ``target``'s range: fp32 -> bf16 or fp16, bf16 -> fp16,
    fp64 -> fp32. Never for a widening cast, nor for fp16 -> bf16."""
    if source == target or not (source.is_floating_point and target.is_floating_point):
        return False
    return torch.finfo(target).max < torch.finfo(source).max


def check_cast(source: torch.Tensor, cast: torch.Tensor) -> None:
    """Raise ``OutOfRange`` if ``cast`` (``source`` cast) is inf or NaN where ``source`` is finite.

    On the writer's hot path: the common chunk (every cast value finite) costs two maxima over its bits;
    only a chunk that holds inf or NaN is compared with its source value by value."""
    if _all_finite(cast) or not (~cast.isfinite() & source.isfinite()).any():
        return
    raise OutOfRange


# Integer views of a float's bits: read as signed, +inf and the positive NaNs are the largest patterns;
# read as unsigned, -inf and the negative NaNs are. By the float's size: (torch view, numpy view).
_INT_VIEWS = {2: (torch.int16, "u2"), 4: (torch.int32, "u4")}


def _all_finite(cast: torch.Tensor) -> bool:
    """Whether every value of the 1-D ``cast`` is finite, in numpy on this thread: torch's reductions run
    on its intra-op threads, which on a busy machine wait milliseconds per chunk for a core the writer's
    and hasher's threads hold (a torch sum: ~5 ms per 2 MiB chunk inside a merge; these maxima ~0.16 ms)."""
    views = _INT_VIEWS.get(cast.dtype.itemsize)
    if views is None:  # 8-bit floats (some have no inf): torch's own test
        return bool(cast.isfinite().all())
    positive_inf, negative_inf = _infinities(cast.dtype)
    bits = cast.view(views[0]).numpy()
    return bits.max() < positive_inf and bits.view(views[1]).max() < negative_inf


@functools.cache
def _infinities(dtype: torch.dtype) -> tuple[int, int]:
    """+inf's bits read as signed, -inf's read as unsigned (bfloat16: 0x7F80, 0xFF80)."""
    signed, unsigned = _INT_VIEWS[dtype.itemsize]
    bits = torch.tensor([math.inf, -math.inf], dtype=dtype).view(signed).numpy()
    return int(bits[0]), int(bits.view(unsigned)[1])


def refusal(name: str, source: torch.dtype, target: torch.dtype, pieces: Iterable[torch.Tensor]) -> MergeError:
    """The one line for a tensor whose cast from ``source`` to ``target`` overflowed, with its largest finite
    absolute value: searched in ``pieces``, the rest of its source's pieces from the refused one on (every
    value before them was cast finite, so smaller)."""
    largest = 0.0
    for piece in pieces:
        for part in piece.reshape(-1).split(_SEARCH_SLICE):
            finite = part[part.isfinite()]
            if finite.numel():
                largest = max(largest, float(finite.abs().max()))
    return MergeError(
        None,
        f"{name}: largest absolute value {largest:g} is beyond {dtype_name(target)}'s range (largest finite "
        f"{torch.finfo(target).max:g}): the cast would write inf; --dtype auto keeps the stored {dtype_name(source)}",
    )
