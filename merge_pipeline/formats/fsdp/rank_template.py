"""Rank files that differ from a verified one only in the rank's own numbers are checked by bytes.

At world size 1024 every rank file holds the same DTensors on the same one-dimensional mesh; a
rank's pickle differs from another's of the same local shapes only in the mesh's ``_rank`` and
``_coordinate_on_dim`` integers (checked with a byte diff of verl-style rank files). So once one
rank file is fully unpickled and verified, another one is accepted without unpickling when its
pickle is byte for byte that file's pickle with exactly those integers set to its own rank and
mesh coordinate: it then unpickles to the same state dict with its own coordinate, so every check
the full path makes holds for it as for the template. Anything else -- one more byte changed, a
different local shape, another mesh -- is not matched and goes the full way (verified or refused).
Only where each storage lies in the file (its zip record) is read per file.
"""

from __future__ import annotations

import pickle
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from merge_pipeline.formats.torch_files import TorchArchive

# The mesh's own-rank fields as protocol-2 pickles write them: the key, its memo put, the int(s).
_MEMO_PUT = rb"(?:q.|r....)"
_INT = rb"(?:K.|M..|J....)"
_RANK = re.compile(rb"X\x05\x00\x00\x00_rank" + _MEMO_PUT + rb"(" + _INT + rb")", re.DOTALL)
_COORDINATE = re.compile(rb"X\x12\x00\x00\x00_coordinate_on_dim" + _MEMO_PUT + rb"(" + _INT + rb")[\x85]", re.DOTALL)


def _encoded(value: int) -> bytes:
    """An int as pickle protocol 2 writes it (what ``_INT`` matches)."""
    if 0 <= value < 256:
        return pickle.BININT1 + bytes([value])
    if 0 <= value < 65536:
        return pickle.BININT2 + struct.pack("<H", value)
    return pickle.BININT + struct.pack("<i", value)


@dataclass(frozen=True)
class _Tensor:
    """One tensor of the template: its storage record, its local view, how the mesh splits it."""

    name: str
    key: str  # the storage record
    nbytes: int
    meta: torch.Tensor  # the local shard's view of its storage
    shape: tuple[int, ...]  # the local shard's
    split_dim: int | None  # Shard(d) on the mesh, or None (replicated)
    rows: int  # global size of split_dim
    chunk: int  # torch.chunk's rows per rank
    run: tuple[int, int] | None  # (start in the storage, length) when the view is contiguous

    def offset(self, rank: int) -> tuple[int, ...] | None:
        """Where ``rank``'s piece sits in the global tensor, if its shape is the template's (``torch.chunk``)."""
        if self.split_dim is None:
            return (0,) * len(self.shape)
        start = min(rank * self.chunk, self.rows)
        if max(0, min(self.chunk, self.rows - start)) != self.shape[self.split_dim]:
            return None
        return tuple(start if d == self.split_dim else 0 for d in range(len(self.shape)))


@dataclass(frozen=True)
class RankTemplate:
    """A verified rank file's pickle cut at its mesh's ``_rank`` and coordinate, and its tensors' storages."""

    literals: tuple[bytes, ...]  # the pickle between the rank-dependent integers
    tensors: tuple[_Tensor, ...]
    splits: frozenset[tuple[int, int, int]]  # each split tensor's (rows, torch.chunk's rows per rank, local rows)

    @classmethod
    def of(cls, archive: TorchArchive, state: dict, rank: int) -> RankTemplate | None:
        """The template of a fully verified rank file, or ``None`` if its layout is not one a template can
        stand for: every value a ``Shard``/``Replicate`` DTensor on one 1-D mesh whose pickled ``_rank`` and
        coordinate are this file's rank, each named once in the pickle."""
        meshes = {id(v.device_mesh): v.device_mesh for v in state.values() if isinstance(v, DTensor)}
        if len(meshes) != 1 or len(state) != sum(isinstance(v, DTensor) for v in state.values()):
            return None
        mesh = next(iter(meshes.values()))
        if mesh.ndim != 1:
            return None
        pickled = archive.pickled
        ranks, coordinates = list(_RANK.finditer(pickled)), list(_COORDINATE.finditer(pickled))
        if len(ranks) != 1 or len(coordinates) != 1:
            return None
        slots = sorted([ranks[0].span(1), coordinates[0].span(1)])
        if any(pickled[start:end] != _encoded(rank) for start, end in slots):
            return None
        tensors = []
        for name, value in state.items():
            (placement,) = value.placements
            if not (isinstance(placement, Replicate) or type(placement) is Shard):
                return None
            local = value._local_tensor
            storage = local.untyped_storage()
            split_dim = placement.dim if isinstance(placement, Shard) else None
            rows = value.shape[split_dim] if split_dim is not None else 0
            item = local.element_size()
            run = (local.storage_offset() * item, local.numel() * item) if local.is_contiguous() else None
            tensors.append(
                _Tensor(
                    name,
                    storage._checkpoint_key,
                    storage._checkpoint_nbytes,
                    local,
                    tuple(local.shape),
                    split_dim,
                    rows,
                    -(-rows // mesh.size()),
                    run,
                )
            )
        splits = frozenset((t.rows, t.chunk, t.shape[t.split_dim]) for t in tensors if t.split_dim is not None)
        literals = (pickled[: slots[0][0]], pickled[slots[0][1] : slots[1][0]], pickled[slots[1][1] :])
        return cls(literals, tuple(tensors), splits)

    def matches(self, pickled: bytes, rank: int) -> bool:
        """``pickled`` (a rank file's pickle) is this one with the mesh's ``_rank`` and coordinate set to
        ``rank`` (on a 1-D mesh a rank's coordinate is the rank itself)."""
        return pickled == _encoded(rank).join(self.literals)

    def fits(self, rank: int) -> bool:
        """Every local shape is the one ``torch.chunk`` gives ``rank`` (``_Tensor.offset`` is not ``None``),
        checked once per distinct split rather than per tensor."""
        return all(max(0, min(chunk, rows - min(rank * chunk, rows))) == local for rows, chunk, local in self.splits)

    def storage_offsets(self, locate: Callable[[str, int, torch.dtype], int | None]) -> dict[str, int] | None:
        """Where each storage starts in a matching file: ``locate(key, numel, dtype)`` finds its record and
        checks its size (or says ``None``: then nothing is)."""
        offsets: dict[str, int] = {}
        for t in self.tensors:
            if t.key not in offsets:
                found = locate(t.key, t.nbytes // t.meta.element_size(), t.meta.dtype)
                if found is None:
                    return None
                offsets[t.key] = found
        return offsets
