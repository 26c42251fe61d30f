"""The FP4 tables against compressed-tensors' own CPU rounding and packing, bit for bit, on their domains."""

from __future__ import annotations

import pytest
import torch

from merge_pipeline.engine import fp4_tables

pytest.importorskip("compressed_tensors")


def _bits_equal(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    return ours.dtype == theirs.dtype and torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))


def test_bfloat16_rounding_is_the_library_s_on_every_bfloat16_value():
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    assert _bits_equal(fp4_tables.cast_to_fp4_by_table(every), fp4_tables.library("cast_to_fp4")(every.clone()))


def test_float32_rounding_is_the_library_s_at_both_ends_of_every_upper_half():
    """Each upper half's float32 values with a lower half of 0, then 1 to 65,535: the table holds the library's
    output on the first and on the least of the others. Rounding to the nearest FP4 value is monotone, so equal
    outputs on the least and the greatest of the others make it constant over them: checked for every upper half,
    with the neighbours of each end and a few values between them."""
    torch.manual_seed(0)
    upper = torch.arange(1 << 16, dtype=torch.int32) << 16
    lower = torch.tensor([0, 1, 2, 0x7FFF, 0x8000, 0xFFFE, 0xFFFF, *torch.randint(3, 0xFFFE, (8,)).tolist()])
    values = (upper[:, None] | lower[None, :].to(torch.int32)).view(torch.float32)
    values = values[~values.isnan()]  # the next test's
    assert values.isinf().sum() == 2
    assert _bits_equal(fp4_tables.cast_to_fp4_by_table(values), fp4_tables.library("cast_to_fp4")(values.clone()))


def test_float32_rounding_of_values_with_a_nan_is_the_library_s():
    values = torch.tensor([0x7F800001, 0x7FC12345, -1, 0x3E800001, 0x40A00000], dtype=torch.int32).view(torch.float32)
    assert _bits_equal(fp4_tables.cast_to_fp4_by_table(values), fp4_tables.library("cast_to_fp4")(values.clone()))


def test_packing_is_the_library_s_on_every_pair_of_fp4_values():
    values = fp4_tables.fp4_values()
    assert len(values) == 16  # eight magnitudes, each signed (-0.0 too)
    first, second = torch.meshgrid(values, values, indexing="ij")
    pairs = torch.stack([first.reshape(-1), second.reshape(-1)], dim=1).reshape(16, 32)
    assert _bits_equal(fp4_tables.pack_fp4_to_uint8_by_table(pairs), fp4_tables.library("pack_fp4_to_uint8")(pairs))


def test_packing_anything_else_is_the_library_s():
    """Values that are not FP4 (the library's packing is undefined for them) and odd widths: the library's own."""
    torch.manual_seed(0)
    values = torch.randn(8, 64).to(torch.bfloat16)
    assert _bits_equal(fp4_tables.pack_fp4_to_uint8_by_table(values), fp4_tables.library("pack_fp4_to_uint8")(values))
    with pytest.raises(ValueError, match="even number of columns"):
        fp4_tables.pack_fp4_to_uint8_by_table(torch.zeros(2, 3, dtype=torch.bfloat16))


def test_quantizing_a_band_goes_through_the_tables():
    """The library's NVFP4 and MXFP4 compressors, called by the merge, dispatch to the tables on the CPU."""
    from compressed_tensors.utils.impl_backend import ImplBackend

    fp4_tables.register()
    for name, ours in (
        ("cast_to_fp4", fp4_tables.cast_to_fp4_by_table),
        ("pack_fp4_to_uint8", fp4_tables.pack_fp4_to_uint8_by_table),
    ):
        cpu = [fn for fn, req, _ in ImplBackend._backends[name] if req(torch.zeros(2, 2, dtype=torch.bfloat16))]
        assert cpu[:1] == [ours], name
