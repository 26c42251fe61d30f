"""The safetensors files of a Hugging Face folder: their names, the dtype table, and header reading.

Headers of finished files are read with the ``safetensors`` package (``safe_open`` validates the
header, the offsets and the dtypes); a reader that needs byte offsets parses the header itself.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from merge_pipeline.errors import MergeError
from merge_pipeline.input_files import open_regular

INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# The safetensors library refuses a header over 100 MB, and reserves this name in it for string metadata.
MAX_HEADER_BYTES = 100_000_000
METADATA_KEY = "__metadata__"

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


def exact_common_dtype(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The narrowest floating dtype holding every value of both floating dtypes exactly (bf16 and fp32: fp32;
    bf16 and fp16: fp32). torch promotes no 8-bit float type: float32 holds each exactly."""
    if a == b:
        return a
    return torch.promote_types(*(torch.float32 if d.itemsize == 1 else d for d in (a, b)))


@contextlib.contextmanager
def open_safetensors(path: Path) -> Iterator:
    """``safe_open`` a finished file; a missing, special or malformed one is one line naming it."""
    os.close(open_regular(path))  # checked first: safe_open would block on a FIFO
    try:
        with safe_open(path, "pt") as f:
            yield f
    except SafetensorError as exc:
        raise MergeError(path, f"not a readable safetensors file ({exc})") from None


def read_header(path: Path) -> dict[str, dict]:
    """name -> dtype (as the header spells it), shape and data bytes of each tensor; ``safe_open`` validates the header."""
    entries = {}
    with open_safetensors(path) as f:
        for name in f.keys():
            entry = f.get_slice(name)
            dtype, shape = entry.get_dtype(), entry.get_shape()
            entries[name] = {"dtype": dtype, "shape": shape, "nbytes": math.prod(shape) * TORCH_DTYPES[dtype].itemsize}
    return entries
