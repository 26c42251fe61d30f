"""Tensors cut into many small pieces are read file by file, a group of tensors at a time.

At world size 1024 a 1024 x 1024 weight is 1024 pieces of 4 KB, one per rank file, and a rank
file's pieces of consecutive tensors lie next to each other (torch.save writes the storages in
order, a zip header between them). Read tensor by tensor, that is one read per piece and, with at
most ``MAX_OPEN_FILES`` descriptors, an open and close of a rank file per piece. Instead a group
of consecutive small-piece tensors (at most ``GROUP_BYTES``) is loaded at once: each rank file is
opened once per group and its pieces land straight in their places in the group's buffer, one
``preadv`` per run of neighbouring pieces (the headers between them read into a scratch buffer).
The writer then takes each tensor of the group from that buffer.

A source may describe its pieces as ``RunBlock``s, the same byte range of each of several files: an
FSDP tensor's pieces lie at the same offset of every rank file of one zip layout and template. The
reads are then worked out once per block, not per piece; what still grows with the world size is one
open and one ``preadv`` per rank file and group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from merge_pipeline.plan import PlannedTensor, SourceFile

# A group's buffer holds at most this many source bytes. Each group costs an open and a read of every
# rank file: at world size 1024, 32 MB groups of a 248M model cost ~0.2 s more CPU, and the peak RSS
# (set after the writing, by the checks) stayed the same with 64 MB.
GROUP_BYTES = 64 << 20
# Tensors whose pieces average less than this are grouped; larger pieces are read well one by one.
SMALL_PIECE_BYTES = 1 << 20
# Neighbouring pieces at most this far apart in a file are read by one preadv (the gap into scratch).
_MAX_GAP = 4096
_MAX_BUFFERS = 512  # per preadv, well under the system's IOV_MAX (1024 on Linux)


@dataclass(frozen=True, slots=True)
class RunBlock:
    """``length`` bytes at ``offset`` of each of ``files``, in turn: a tensor's bytes are its blocks' in order."""

    files: tuple[SourceFile, ...]
    offset: int
    length: int


def run_blocks(source) -> list[RunBlock] | None:
    """``source``'s bytes as blocks: its own ``run_blocks()``, else one per run of ``byte_runs()`` (e.g.
    ``StoredBytes``); ``None`` when they are not plain file ranges."""
    if (blocks := getattr(source, "run_blocks", None)) is not None:
        return blocks()
    runs = source.byte_runs()
    return None if runs is None else [RunBlock((run.file,), run.offset, run.length) for run in runs]


def coalesced(tensors: list[PlannedTensor]) -> list[PlannedTensor]:
    """``tensors`` with each run of consecutive small-piece tensors whose bytes are file ranges
    (``run_blocks``) read as a group."""
    out: list[PlannedTensor] = []
    group: list[PlannedTensor] = []
    loaded = _Loaded()

    def flush() -> None:
        if group:
            loaded.last = _Group(loaded, list(group))
            out.extend(loaded.last.tensors())
            group.clear()

    for t in tensors:
        # a tensor over GROUP_BYTES keeps its piece-by-piece reads: its pieces are large enough, and
        # one buffer of it all would grow the peak memory by the tensor
        blocks = run_blocks(t.source) if t.nbytes() <= GROUP_BYTES else None
        pieces = sum(len(b.files) for b in blocks if b.length) if blocks is not None else 0
        if 1 < pieces and t.nbytes() < SMALL_PIECE_BYTES * pieces:
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
    """The one group whose bytes are in memory now (loading another frees it first): which of its
    members were read, and where each starts in the buffer."""

    group: _Group | None = None
    buffer: torch.Tensor | None = None
    places: dict[int, int] = field(default_factory=dict)
    # The buffer of a group whose members were all taken: no piece of it is valid any more, so the next
    # load reads into it (fresh pages cost the kernel about as much again as the reading). None once the
    # last group is written, so that it does not add to the peak of what follows the writing.
    spare: torch.Tensor | None = None
    last: _Group | None = None


@dataclass(eq=False)
class _Group:
    """Consecutive tensors whose bytes are plain file ranges (``run_blocks``), read together. Their blocks
    are asked for only when the group is read, so the plan holds no object per piece.

    A load reads the member asked for and every later one not yet taken, never an earlier one: a
    writer that takes only some members (a torchrun rank whose output files end or start inside the
    group) or takes them out of order (its files are written biggest first) reads each member at most
    once, and no member before the first it wants."""

    loaded: _Loaded
    members: list[PlannedTensor]
    taken: set[int] = field(default_factory=set)

    def tensors(self) -> list[PlannedTensor]:
        return [PlannedTensor(t.name, t.shape, t.dtype, _GroupedBytes(self, i)) for i, t in enumerate(self.members)]

    def bytes_of(self, index: int) -> torch.Tensor:
        loaded = self.loaded
        if loaded.group is not self or index not in loaded.places:
            loaded.group = loaded.buffer = None  # free the previous group's bytes first
            wanted = [index] + [i for i in range(index + 1, len(self.members)) if i not in self.taken]
            loaded.buffer, loaded.places = self._read(wanted, loaded)
            loaded.group = self
        start = loaded.places[index]
        return loaded.buffer[start : start + self.members[index].nbytes()]

    def take(self, index: int) -> None:
        """``index`` was written: once every member read is, the buffer is the next load's."""
        self.taken.add(index)
        if self.loaded.group is self and self.taken.issuperset(self.loaded.places):
            done = self is self.loaded.last and len(self.taken) == len(self.members)
            self.loaded.spare = None if done else self.loaded.buffer
            self.loaded.group = self.loaded.buffer = None
            self.loaded.places = {}

    def _read(self, wanted: list[int], loaded: _Loaded) -> tuple[torch.Tensor, dict[int, int]]:
        # per set of files, its blocks: (offset in each file, length, place of the first file's bytes)
        by_files: dict[tuple[SourceFile, ...], list[_Run]] = {}
        places, nbytes = {}, 0
        for index in wanted:
            places[index] = nbytes
            for block in run_blocks(self.members[index].source):
                if block.length:
                    by_files.setdefault(block.files, []).append((block.offset, block.length, nbytes))
                    nbytes += len(block.files) * block.length
        buffer, loaded.spare = loaded.spare, None
        if buffer is None or len(buffer) < nbytes:
            buffer = None  # freed before a bigger one is taken
            buffer = torch.empty(nbytes, dtype=torch.uint8)
        view = memoryview(buffer.numpy())[:nbytes]
        scratch = memoryview(bytearray(_MAX_GAP))
        for files, runs in by_files.items():
            runs.sort()
            spans: list[list[_Run]] = [[]]
            for run in runs:
                if spans[-1]:
                    last = spans[-1][-1]
                    gap = run[0] - (last[0] + last[1])
                    if not 0 <= gap <= _MAX_GAP or 2 * len(spans[-1]) >= _MAX_BUFFERS:
                        spans.append([])
                spans[-1].append(run)
            for i, file in enumerate(files):  # each file's spans one after the other, the files in order
                for span in spans:
                    _read_span(file, i, span, view, scratch)
        return buffer, places


# A block's (offset in each of its files, length, place in the buffer of its first file's bytes).
_Run = tuple[int, int, int]


def _read_span(file: SourceFile, i: int, span: list[_Run], view: memoryview, scratch) -> None:
    """Neighbouring blocks' bytes of their ``i``-th file, ``file``, into their places by one preadv (the
    gaps into ``scratch``)."""
    buffers, end = [], span[0][0]
    for offset, length, place in span:
        if offset > end:
            buffers.append(scratch[: offset - end])
        buffers.append(view[place + i * length : place + (i + 1) * length])
        end = offset + length
    done = file.preadv(buffers, span[0][0])
    if done != end - span[0][0]:
        for offset, length, place in span:  # short: read block by block, which names the truncated file
            file.read_into(view[place + i * length : place + (i + 1) * length], offset)


@dataclass(frozen=True)
class _GroupedBytes:
    """One tensor of a group: its bytes in the group's buffer."""

    group: _Group
    index: int

    def byte_runs(self) -> None:
        return None

    def pieces(self):
        member = self.group.members[self.index]
        yield self.group.bytes_of(self.index).view(member.dtype)
        self.group.take(self.index)
