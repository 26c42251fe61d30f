"""compressed-tensors' FP4 rounding and packing on the CPU, looked up in tables of their own outputs.

On the CPU the library rounds to FP4 E2M1 (``cast_to_fp4``) with eight masked assignments over the values and
packs the codes (``pack_fp4_to_uint8``) with seven more: most of an NVFP4A16 or MXFP4A16 merge's time. Both are
elementwise over small domains, so each is tabulated once by calling it on the inputs of that domain, and the
tables are registered as the library's CPU backend of the same operation (its ``ImplBackend`` dispatch, the one
its Triton kernels use on GPUs): the library's ``quantize`` and compressors call them as they call their own.

- ``cast_to_fp4`` of bfloat16 values (MXFP4's): one entry for each of the 65,536 bit patterns.
- ``cast_to_fp4`` of float32 values (NVFP4's, divided by a float32 scale): its thresholds lie on the bfloat16
  grid and it rounds to the nearest FP4 value (monotone), so its output depends only on a value's upper 16 bits
  and on whether its lower 16 are zero: one entry for each pair (2 x 65,536), the library's output on the
  pair's smallest value; values with a NaN (whose payload passes through) go to the library's own.
- ``pack_fp4_to_uint8`` of bfloat16 FP4 values (what ``cast_to_fp4`` returns, the only input it is defined for), two a
  byte: the library's byte of each pair of the 16 values (256) is the sum of what each value puts in its own nibble,
  so two tables over the bfloat16 patterns give each value's share, first and second; any other input (a pattern
  that is no FP4 value) goes to the library's own.

merge_pipeline_tests/engine/test_fp4_tables.py checks each table against the library on its domain (the float32
one at both ends of every upper half; it was also compared once on all 2^32 patterns but NaNs: equal).
"""

from __future__ import annotations

import functools

import torch

_HALF = 16  # bits in each half of a float32; a bfloat16 is its upper half
_NOT_FP4 = -1024  # below minus any byte


@functools.cache
def register() -> None:
    """Make the tables the library's CPU backend of both operations (once a process; after its GPU kernels)."""
    from compressed_tensors.utils.impl_backend import ImplBackend

    ImplBackend.register("cast_to_fp4", functools.partial(_on_cpu, (torch.float32, torch.bfloat16)), 1)(
        cast_to_fp4_by_table
    )
    ImplBackend.register("pack_fp4_to_uint8", functools.partial(_on_cpu, (torch.bfloat16,)), 1)(
        pack_fp4_to_uint8_by_table
    )


def library(name: str):
    """The library's own CPU implementation of operation ``name`` (its eager fallback), whatever is registered."""
    from compressed_tensors.utils.impl_backend import ImplBackend

    return ImplBackend._fn_registry[name]


def cast_to_fp4_by_table(x: torch.Tensor) -> torch.Tensor:
    """``cast_to_fp4`` of ``x`` (float32 or bfloat16), looked up."""
    if x.dtype == torch.bfloat16:
        return cast_table(torch.bfloat16).index_select(0, _bits(x).view(-1)).view(x.shape)
    if not bool(torch.isfinite(x.sum())) and bool(x.isnan().any()):  # a finite sum: no NaN (one cheap pass)
        return library("cast_to_fp4")(x)  # a NaN's payload is its own: the library's answer
    # Each value's (lower, upper) halves: torch's CPUs are little-endian.
    halves = x.reshape(-1).view(torch.int16).view(-1, 2)
    keys = torch.add(halves[:, 0] != 0, halves[:, 1].view(torch.uint16).to(torch.int32), alpha=2)
    return cast_table(torch.float32).index_select(0, keys).view(x.shape)


def pack_fp4_to_uint8_by_table(x: torch.Tensor) -> torch.Tensor:
    """``pack_fp4_to_uint8`` of bfloat16 FP4 values ``x`` (``[rows, cols]``), looked up."""
    first, second = pack_tables()
    rows, cols = x.shape
    if cols % 2:
        return library("pack_fp4_to_uint8")(x)  # the library's answer (an error) to an odd width
    bits = _bits(x).view(-1, 2)
    packed = first.index_select(0, bits[:, 0]) + second.index_select(0, bits[:, 1])
    if bool(packed.min() < 0):
        return library("pack_fp4_to_uint8")(x)  # not FP4 values: the library's answer
    return packed.to(torch.uint8).view(rows, cols // 2)


@functools.cache
def cast_table(dtype: torch.dtype) -> torch.Tensor:
    """``cast_to_fp4`` of every bfloat16 value, or of the smallest float32 value of each key (upper half, lower
    half zero or not)."""
    keys = torch.arange(1 << (_HALF + (dtype == torch.float32)), dtype=torch.int32)
    if dtype == torch.bfloat16:
        smallest = keys.to(torch.int16).view(torch.bfloat16)
    else:
        smallest = (((keys >> 1) << _HALF) | (keys & 1)).view(torch.float32)
    return library("cast_to_fp4")(smallest.clone())


@functools.cache
def pack_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """What each bfloat16 pattern adds to the library's packed byte as the first and as the second value of a pair
    (``_NOT_FP4`` for a pattern that is no FP4 value: any sum with it is negative). Checked on every pair."""
    values = fp4_values()
    first, second = torch.meshgrid(values, values, indexing="ij")
    pairs = library("pack_fp4_to_uint8")(torch.stack([first.reshape(-1), second.reshape(-1)], dim=1))
    pairs = pairs.view(len(values), len(values)).to(torch.int16)
    as_first, as_second = pairs[:, 0], pairs[0, :] - pairs[0, 0]
    if not torch.equal(pairs, as_first[:, None] + as_second[None, :]):
        raise RuntimeError("compressed-tensors' pack_fp4_to_uint8 no longer packs each value on its own")
    tables = torch.full((2, 1 << _HALF), _NOT_FP4, dtype=torch.int16)
    tables[0, _bits(values)], tables[1, _bits(values)] = as_first, as_second
    return tables[0], tables[1]


def fp4_values() -> torch.Tensor:
    """The FP4 values ``cast_to_fp4`` returns (bfloat16, -0.0 among them), by their bits."""
    table = cast_table(torch.bfloat16)
    return table[table.isfinite()].view(torch.int16).unique().view(torch.bfloat16)


def _on_cpu(dtypes: tuple[torch.dtype, ...], x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in dtypes


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The bit pattern of each bfloat16 value, as int32 from 0 to 65,535."""
    return x.contiguous().view(torch.uint16).to(torch.int32)
