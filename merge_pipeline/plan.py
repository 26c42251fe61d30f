"""The merge plan: what a format reader hands the writer.

A reader describes every output tensor (HF name, shape, source dtype, where its bytes come from)
without loading tensor data. The writer consumes the plan one tensor at a time, so peak memory is
bounded by the largest single tensor, never by the model.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypedDict

import torch

from merge_pipeline.errors import MergeError
from merge_pipeline.options import MergeOptions
from merge_pipeline.store.sources import ByteSource, SourceRange
from merge_pipeline.store.view import byte_source

# Reads are done in pieces of at most this many bytes, so a cast or a copy never holds more.
READ_PIECE_BYTES = 8 * 1024 * 1024


_COUNTING = threading.Lock()  # the writer thread's kernel copies and this thread's reads may count one file at once


class SourceFile:
    """An input file of the plan: its bytes come from a ``ByteSource`` (a local file, or an object in a
    store that a view's placeholder stands for), checked and measured at planning time."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.source: ByteSource = byte_source(self.path)
        self.identity = self.source.identity
        self.size = self.source.size
        self.bytes_read = 0  # tensor bytes taken from it (``counted``): what a launcher reports per node

    def opened(self) -> contextlib.AbstractContextManager[int | None]:
        """The file's descriptor, kept open while the block runs (``None`` where it has none: a store object)."""
        return self.source.opened()

    def check_unchanged(self) -> None:
        """Refuse a file rewritten or replaced since it was planned: what we read of it may mix two saves."""
        self.source.check_unchanged()

    def read_into(self, buffer: memoryview, offset: int) -> None:
        """Fill ``buffer`` with the bytes at ``offset``; a short read means the file was truncated."""
        done = 0
        while done < len(buffer):
            n = self.source.readv([buffer[done:]], offset + done)
            if n == 0:
                raise MergeError(
                    self.path, f"file ends at byte {offset + done}, expected data up to byte {offset + len(buffer)}"
                )
            done += self.counted(n)

    def counted(self, n: int) -> int:
        """``n`` bytes were read from this file (by ``read_into``, a grouped read or a kernel copy); returns ``n``."""
        with _COUNTING:
            self.bytes_read += n
        return n

    def pread(self, length: int, offset: int) -> bytes:
        """Up to ``length`` bytes at ``offset`` (fewer at the end), as ``os.pread``: for reading metadata."""
        return self.source.read(offset, length)

    def preadv(self, buffers: list[memoryview], offset: int) -> int:
        """Fill ``buffers`` in turn from ``offset`` (one read); the bytes read, as ``os.preadv``."""
        return self.counted(self.source.readv(buffers, offset))

    def advise_will_need(self, offset: int, length: int) -> None:
        """Start reading this range ahead (the page cache; a store object: GETs ahead)."""
        self.source.prefetch(offset, length)

    def close(self) -> None:
        self.source.close()


class FileRange(SourceRange):
    """A window onto part of a plan's input file (one chunk's torch.save archive) read through the file:
    its bytes counted, and a file that ends early refused."""

    def __init__(self, file: SourceFile, offset: int, length: int):
        super().__init__(file.source, offset, length)
        self.file = file

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self.length - self.position))
        if n:
            self.file.read_into(memoryview(buffer)[:n], self.offset + self.position)
        self.position += n
        return n


# Checks in flight at once (a HEAD each for objects in a store: a 1024-rank checkpoint is 64 round trips, not 1024).
CHECKS_AT_ONCE = 16


def check_unchanged(files: Iterable[SourceFile]) -> None:
    """Before publishing: every input file is still what was planned (``SourceFile.check_unchanged``),
    asked concurrently (a local file is one ``stat``, an object in a store a HEAD); the first change in file
    order is refused."""
    files = list(files)
    if files:
        with ThreadPoolExecutor(min(len(files), CHECKS_AT_ONCE), thread_name_prefix="merge-check") as pool:
            for _ in pool.map(SourceFile.check_unchanged, files):
                pass


def close_all(files: Iterable[SourceFile]) -> None:
    for f in files:
        f.close()


@contextlib.contextmanager
def closed_on_failure(files: Iterable[SourceFile]) -> Iterator[None]:
    """Close ``files`` (as the list, or a dict's values view, stands then) if the block raises; on success
    they stay open for the writer."""
    with contextlib.ExitStack() as on_failure:
        on_failure.callback(close_all, files)
        yield
        on_failure.pop_all()


def dtype_name(dtype: torch.dtype) -> str:
    """``bfloat16`` for ``torch.bfloat16``: how config.json, the manifest and ``inspect`` name a dtype."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)  # slots: a plan of 1024 rank files holds ~100k of them
class ByteRun:
    """``length`` contiguous bytes of ``file`` starting at ``offset``."""

    file: SourceFile
    offset: int
    length: int


class TensorSource(Protocol):
    """Where a tensor's bytes come from.

    ``pieces()`` yields contiguous CPU tensors of the source dtype whose flattened concatenation is
    the tensor in row-major order. A piece is valid only until the next one is requested (sources
    may reuse one buffer), so consumers copy or write each piece before asking for more. ``byte_runs()`` returns the same bytes as plain file ranges when
    the tensor is a straight concatenation of stored bytes (then the writer copies bytes and does no
    per-element work), or ``None``.
    """

    def pieces(self) -> Iterator[torch.Tensor]: ...

    def byte_runs(self) -> list[ByteRun] | None: ...


def regrouped(pieces: Iterable[torch.Tensor], buffer: torch.Tensor) -> Iterator[int]:
    """A source's pieces re-cut into units of ``buffer`` (1-D): each is copied into it, and the element
    count is yielded each time it is full, then once more for a partial remainder."""
    filled = 0
    for piece in pieces:
        piece, taken = piece.reshape(-1), 0
        while taken < piece.numel():
            n = min(buffer.numel() - filled, piece.numel() - taken)
            buffer[filled : filled + n] = piece[taken : taken + n]
            filled, taken = filled + n, taken + n
            if filled == buffer.numel():
                yield filled
                filled = 0
    if filled:
        yield filled


@dataclass(frozen=True)
class StoredBytes:
    """A tensor whose row-major bytes are the concatenation of file ranges (e.g. Shard(0) chunks)."""

    runs: tuple[ByteRun, ...]
    dtype: torch.dtype

    def byte_runs(self) -> list[ByteRun]:
        return list(self.runs)

    def pieces(self) -> Iterator[torch.Tensor]:
        item = self.dtype.itemsize
        step = max(item, READ_PIECE_BYTES // item * item)
        # One buffer, reused; torch.empty, not bytearray: no pass zeroing bytes about to be read over.
        buffer = memoryview(
            torch.empty(min(step, max((run.length for run in self.runs), default=0)), dtype=torch.uint8).numpy()
        )
        for run in self.runs:
            for start in range(0, run.length, step):
                length = min(step, run.length - start)
                view = buffer[:length]
                run.file.read_into(view, run.offset + start)
                yield torch.frombuffer(view, dtype=self.dtype)


@dataclass(frozen=True)
class Computed:
    """A tensor that needs work to build (a concatenation on dim > 0, a LoRA merge, a QKV split).

    ``build`` returns the whole tensor; it is called only when the writer reaches it.
    """

    build: Callable[[], torch.Tensor]

    def byte_runs(self) -> None:
        return None

    def pieces(self) -> Iterator[torch.Tensor]:
        yield self.build().contiguous()


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # the dtype the source yields
    source: TensorSource

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        return self.numel * (dtype or self.dtype).itemsize

    def load(self) -> torch.Tensor:
        """The whole tensor in memory (for work that needs it all: LoRA merges, comparisons)."""
        whole = torch.empty(self.numel, dtype=self.dtype)
        position = 0
        for piece in self.source.pieces():
            whole[position : position + piece.numel()].copy_(piece.reshape(-1))
            position += piece.numel()
        return whole.view(self.shape)


@dataclass(frozen=True)
class LoraInfo:
    """LoRA training settings recorded beside the checkpoint (verl's ``lora_train_meta.json``)."""

    r: int
    lora_alpha: int | float  # exactly as the file says: 16.5 stays 16.5 (PEFT scales by alpha / r)
    task_type: str = "CAUSAL_LM"


class LayoutFacts(TypedDict, total=False):
    """How a checkpoint is laid out, as ``inspect`` shows it and the manifest records it: each reader
    fills the facts of its format (the input folder's; the output's layout is the engine's OutputPlan)."""

    world_size: int  # fsdp: the rank files, and how rank 0's first DTensor is placed
    fsdp_version: int
    mesh_shape: list[int]
    mesh_dim_names: list[str]
    placements: list[str]
    layout_schema: str  # megatron: verl's "v2", "v2 without ckpt_contents.json" or "v1", and its parallel sizes
    model_weights: str
    sharded_backend: str
    tp: int | None
    pp: int | None
    ep: int | None
    vpp: int | None
    num_layers: int
    layer_keys: str
    tie_word_embeddings: bool
    zero_stage: int  # deepspeed
    dp_world_size: int
    tag: str
    ds_version: str | None
    dcp_source: str  # dcp: torchtitan, accelerate, NeMo-RL, ...
    dcp_folder: str
    skipped_entries: int
    weights: str  # hf (consolidated safetensors), and Megatron's bridge output
    lora_adapter: str
    base_weights: str
    base_model: str  # a LoRA-only checkpoint completed with --hf_model_path's weights
    dtypes: list[str]  # several formats: the stored dtypes, tensors, chunks and files
    stored_tensors: int
    chunks: int
    files: int
    averaged_inputs: list[dict]  # an average: each input's path, backend and weight
    accumulate: str  # and the dtype its weighted sum was accumulated in


@dataclass
class CheckpointPlan:
    """Everything the engine needs to turn one role folder into an HF folder."""

    backend: str  # the name of the reader that planned it (formats.BACKENDS)
    role_dir: Path
    hf_dir: Path | None  # the checkpoint's huggingface/ folder (config, tokenizer, ...)
    tensors: list[PlannedTensor]  # model tensors, HF names (LoRA names as PEFT wrote them)
    files: list[SourceFile]  # every input file the tensors read from
    is_value_model: bool = False
    lora: LoraInfo | None = None
    # True when the names must be checked against the architecture config.json describes: they were
    # produced by a mapping (Megatron -> HF) or taken from a base model; False when they are the
    # trained HF model's own state-dict keys (FSDP), where the check would cost seconds for nothing.
    check_against_architecture: bool = True
    layout: LayoutFacts = field(default_factory=dict)
    # What the plan reads through besides its files, released with them: the local views of store
    # prefixes (``store.view.viewed``) that ``pipeline.prepare`` opened for it.
    views: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, compare=False, repr=False)

    def writes_value_model(self, options: MergeOptions) -> bool:
        """The output is a value model (a score head, no lm_head) when the checkpoint is one or the user says so."""
        return self.is_value_model or options.is_value_model

    @property
    def parameter_count(self) -> int:
        return sum(t.numel for t in self.tensors)

    def close(self) -> None:
        close_all(self.files)
        self.views.close()

    def __enter__(self) -> CheckpointPlan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
