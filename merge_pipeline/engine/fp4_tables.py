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
  byte: one entry for each pair of the 16 values (256); any other input goes to the library's own.

merge_pipeline_tests/engine/test_fp4_tables.py checks each table against the library on its domain (the float32
one at both ends of every upper half; it was also compared once on all 2^32 patterns but NaNs: equal).
"""

from __future__ import annotations

import functools

import torch

_HALF = 16  # bits in each half of a float32; a bfloat16 is its upper half


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
    bits = x.contiguous().view(torch.int32)
    keys = (bits >> (_HALF - 1)) & ~1  # the upper half, shifted left by one
    keys += (bits & 0xFFFF) != 0
    keys &= (1 << (_HALF + 1)) - 1
    return cast_table(torch.float32).index_select(0, keys.view(-1)).view(x.shape)


def pack_fp4_to_uint8_by_table(x: torch.Tensor) -> torch.Tensor:
    """``pack_fp4_to_uint8`` of bfloat16 FP4 values ``x`` (``[rows, cols]``), looked up."""
    codes, pairs = pack_tables()
    rows, cols = x.shape
    code = codes.index_select(0, _bits(x).view(-1)).view(-1, 2) if cols % 2 == 0 else None
    if code is None or bool((code < 0).any()):
        return library("pack_fp4_to_uint8")(x)  # not FP4 values, or an odd width: the library's answer
    return pairs.view(-1).index_select(0, code[:, 0] * len(pairs) + code[:, 1]).view(rows, cols // 2)


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
    """Each bfloat16 pattern's index in the list of FP4 values (-1: not one), and the library's packed byte of
    each pair of them (``[first, second]``)."""
    values = fp4_values()
    codes = torch.full((1 << _HALF,), -1, dtype=torch.int32)
    codes[_bits(values).long()] = torch.arange(len(values), dtype=torch.int32)
    first, second = torch.meshgrid(values, values, indexing="ij")
    pairs = library("pack_fp4_to_uint8")(torch.stack([first.reshape(-1), second.reshape(-1)], dim=1))
    return codes, pairs.view(len(values), len(values))


def fp4_values() -> torch.Tensor:
    """The FP4 values ``cast_to_fp4`` returns (bfloat16, -0.0 among them), by their bits."""
    table = cast_table(torch.bfloat16)
    return table[table.isfinite()].view(torch.int16).unique().view(torch.bfloat16)


def _on_cpu(dtypes: tuple[torch.dtype, ...], x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in dtypes


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The bit pattern of each bfloat16 value, as int32 from 0 to 65,535."""
    return x.contiguous().view(torch.uint16).to(torch.int32)
