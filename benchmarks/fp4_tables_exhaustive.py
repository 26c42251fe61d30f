"""The float32 FP4 rounding table (``engine.fp4_tables``) against compressed-tensors' own ``cast_to_fp4`` on every
one of the 2^32 float32 bit patterns but the NaNs (which the table hands to the library): too slow for the test
suite (~6 minutes on 2 cores), whose ``engine/test_fp4_tables.py`` checks both ends of every block of the table.

    .venv/bin/python -m benchmarks.fp4_tables_exhaustive

Prints the number of patterns whose bits differ (0 expected) and exits non-zero on any.
"""

from __future__ import annotations

import sys
import time

import torch

from merge_pipeline.engine import fp4_tables

BLOCK = 1 << 26  # patterns compared at once: 256 MiB of float32


def main() -> int:
    library = fp4_tables.library("cast_to_fp4")
    started, differing = time.perf_counter(), 0
    for start in range(-(1 << 31), 1 << 31, BLOCK):
        values = torch.arange(start, start + BLOCK, dtype=torch.int32).view(torch.float32)
        values = values[~values.isnan()]
        if values.numel():
            expected, looked_up = library(values.clone()), fp4_tables.cast_to_fp4_by_table(values)
            assert looked_up.dtype == expected.dtype, (looked_up.dtype, expected.dtype)
            bytes_differing = looked_up.view(torch.uint8) != expected.view(torch.uint8)
            differing += int(bytes_differing.view(len(values), -1).any(dim=1).sum())
    print(f"2^32 float32 patterns (NaNs left out): {differing} differ, in {time.perf_counter() - started:.0f} s")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
