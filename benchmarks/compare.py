"""Compare two HF folders' weights tensor by tensor, byte for byte, without torch.

Reads the safetensors headers (8-byte length + JSON) and compares each tensor's dtype, shape and
data bytes in bounded chunks, so it runs in the small benchmark runner at any model size.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

_CHUNK = 16 * 1024 * 1024


@dataclass(frozen=True)
class StoredTensor:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute file offsets
    end: int


@dataclass
class Comparison:
    tensors: int = 0
    equal: int = 0
    only_left: list[str] = field(default_factory=list)
    only_right: list[str] = field(default_factory=list)
    different: list[str] = field(default_factory=list)  # "name: why"

    @property
    def identical(self) -> bool:
        return not (self.only_left or self.only_right or self.different) and self.tensors > 0

    def summary(self) -> str:
        if self.identical:
            return f"identical: {self.equal} tensors, bit for bit"
        parts = [f"{self.equal}/{self.tensors} common tensors equal"]
        if self.only_left:
            parts.append(f"only in ours: {self.only_left[:5]}")
        if self.only_right:
            parts.append(f"only in theirs: {self.only_right[:5]}")
        if self.different:
            parts.append(f"different: {self.different[:5]}")
        return "; ".join(parts)


def read_tensors(hf_dir: Path) -> dict[str, StoredTensor]:
    """Every tensor of the folder's top-level ``*.safetensors`` files (sharded or not)."""
    tensors: dict[str, StoredTensor] = {}
    for path in sorted(Path(hf_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        base = 8 + length
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            tensors[name] = StoredTensor(path, info["dtype"], tuple(info["shape"]), base + start, base + end)
    return tensors


def compare_folders(left: Path, right: Path) -> Comparison:
    a, b = read_tensors(left), read_tensors(right)
    result = Comparison(only_left=sorted(set(a) - set(b)), only_right=sorted(set(b) - set(a)))
    for name in sorted(set(a) & set(b)):
        result.tensors += 1
        x, y = a[name], b[name]
        if (x.dtype, x.shape) != (y.dtype, y.shape):
            result.different.append(f"{name}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}")
        elif not _same_bytes(x, y):
            result.different.append(f"{name}: values differ")
        else:
            result.equal += 1
    return result


def _same_bytes(x: StoredTensor, y: StoredTensor) -> bool:
    if x.end - x.start != y.end - y.start:
        return False
    with open(x.file, "rb") as fx, open(y.file, "rb") as fy:
        fx.seek(x.start)
        fy.seek(y.start)
        left = x.end - x.start
        while left:
            n = min(_CHUNK, left)
            if fx.read(n) != fy.read(n):
                return False
            left -= n
    return True
