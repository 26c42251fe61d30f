"""Tensors cut into many small pieces are read file by file, a group of tensors at a time.

At world size 1024 a 1024 x 1024 weight is 1024 pieces of 4 KB, one per rank file, and a rank
file's pieces of consecutive tensors lie next to each other (torch.save writes the storages in
order, a zip header between them). Read tensor by tensor, that is one read per piece and, with at
most ``MAX_OPEN_FILES`` descriptors, an open and close of a rank file per piece. Instead a group
of consecutive small-piece tensors (at most ``GROUP_BYTES``) is loaded at once: each rank file is
opened once per group and its pieces land straight in their places in the group's buffer, one
``preadv`` per run of neighbouring pieces (the headers between them read into a scratch buffer).
The writer then takes each tensor of the group from that buffer, in order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from merge_pipeline.plan import ByteRun, PlannedTensor, SourceFile, StoredBytes

# A group's buffer holds at most this many source bytes.
GROUP_BYTES = 32 << 20
# Tensors whose pieces average less than this are grouped; larger pieces are read well one by one.
SMALL_PIECE_BYTES = 1 << 20
# Neighbouring pieces at most this far apart in a file are read by one preadv (the gap into scratch).
_MAX_GAP = 4096
_MAX_BUFFERS = 512  # per preadv, well under the system's IOV_MAX (1024 on Linux)


def coalesced(tensors: list[PlannedTensor]) -> list[PlannedTensor]:
    """``tensors`` with each run of consecutive small-piece ``StoredBytes`` tensors read as a group."""
    out: list[PlannedTensor] = []
    group: list[PlannedTensor] = []
    loaded = _Loaded()

    def flush() -> None:
        if group:
            out.extend(_Group(loaded, list(group)).tensors())
            group.clear()

    for t in tensors:
        runs = t.source.runs if isinstance(t.source, StoredBytes) else ()
        # a tensor over GROUP_BYTES keeps its piece-by-piece reads: its pieces are large enough, and
        # one buffer of it all would grow the peak memory by the tensor
        if 1 < len(runs) and t.nbytes() <= GROUP_BYTES and sum(r.length for r in runs) < SMALL_PIECE_BYTES * len(runs):
            if group and sum(g.nbytes() for g in group) + t.nbytes() > GROUP_BYTES:
                flush()
            group.append(t)
        else:
            flush()
            out.append(t)
    flush()
    return out


@dataclass
class _Loaded:
    """The one group whose bytes are in memory now (loading another frees it first)."""

    group: _Group | None = None
    buffer: torch.Tensor | None = None


@dataclass(eq=False)
class _Group:
    loaded: _Loaded
    members: list[PlannedTensor]
    nbytes: int = 0
    by_file: dict[SourceFile, list[tuple[ByteRun, int]]] = field(default_factory=dict)  # run, place in buffer

    def __post_init__(self) -> None:
        for t in self.members:
            for run in t.source.runs:
                self.by_file.setdefault(run.file, []).append((run, self.nbytes))
                self.nbytes += run.length

    def tensors(self) -> list[PlannedTensor]:
        grouped, start = [], 0
        for index, t in enumerate(self.members):
            length = sum(r.length for r in t.source.runs)
            last = index == len(self.members) - 1
            grouped.append(PlannedTensor(t.name, t.shape, t.dtype, _GroupedBytes(self, start, length, t.dtype, last)))
            start += length
        return grouped

    def buffer(self) -> torch.Tensor:
        if self.loaded.group is not self:
            self.loaded.group = self.loaded.buffer = None  # free the previous group's bytes first
            self.loaded.buffer = self._read()
            self.loaded.group = self
        return self.loaded.buffer

    def release(self) -> None:
        if self.loaded.group is self:
            self.loaded.group = self.loaded.buffer = None

    def _read(self) -> torch.Tensor:
        buffer = torch.empty(self.nbytes, dtype=torch.uint8)
        view = memoryview(buffer.numpy())
        scratch = memoryview(bytearray(_MAX_GAP))
        for file, runs in self.by_file.items():
            runs = sorted(runs, key=lambda item: item[0].offset)
            with file.opened() as fd:
                span: list[tuple[ByteRun, int]] = []
                for run, place in runs:
                    if span:
                        last = span[-1][0]
                        gap = run.offset - (last.offset + last.length)
                        if not 0 <= gap <= _MAX_GAP or 2 * len(span) >= _MAX_BUFFERS:
                            _read_span(fd, file, span, view, scratch)
                            span = []
                    span.append((run, place))
                _read_span(fd, file, span, view, scratch)
        return buffer


def _read_span(fd: int, file: SourceFile, span: list[tuple[ByteRun, int]], view: memoryview, scratch) -> None:
    """Neighbouring pieces of one file into their places, by one preadv (the gaps into ``scratch``)."""
    buffers, end = [], span[0][0].offset
    for run, place in span:
        if run.offset > end:
            buffers.append(scratch[: run.offset - end])
        buffers.append(view[place : place + run.length])
        end = run.offset + run.length
    if os.preadv(fd, buffers, span[0][0].offset) != end - span[0][0].offset:
        for run, place in span:  # short: read piece by piece, which names the truncated file
            file.read_into(view[place : place + run.length], run.offset)


@dataclass(frozen=True)
class _GroupedBytes:
    """One tensor of a group: its bytes in the group's buffer."""

    group: _Group
    start: int
    length: int
    dtype: torch.dtype
    last: bool  # the group's buffer is freed once this one is taken

    def byte_runs(self) -> None:
        return None

    def pieces(self):
        yield self.group.buffer()[self.start : self.start + self.length].view(self.dtype)
        if self.last:
            self.group.release()
