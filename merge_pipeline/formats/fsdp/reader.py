"""Reader for verl FSDP role folders: ``model_world_size_{W}_rank_{r}.pt`` (+ ``fsdp_config.json``).

Each rank file is a state dict of DTensors (or plain tensors for FSDP1 at world size 1). We trust
the metadata the DTensors carry over file names: every shard's recorded mesh coordinate must match
its file's rank, every rank must hold the same keys and global shapes, and each tensor's pieces
must tile its global shape exactly. Nothing is written before all of that holds.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.tensor import DTensor, Replicate, Shard

from merge_pipeline.errors import MergeError
from merge_pipeline.files.json_files import read_json_object
from merge_pipeline.formats import Reader
from merge_pipeline.formats.coalesced_reads import RunBlock, coalesced
from merge_pipeline.formats.dcp_files import check_tiling
from merge_pipeline.formats.fsdp.archive_layouts import ArchiveLayout
from merge_pipeline.formats.fsdp.rank_template import RankTemplate
from merge_pipeline.formats.step_folders import VERL, StepFolder
from merge_pipeline.formats.torch_files import StoredTensor, stored_tensor, torch_archive
from merge_pipeline.hf.config import has_value_head
from merge_pipeline.hf.lora import LORA_META, read_lora_meta
from merge_pipeline.plan import (
    ByteRun,
    CheckpointPlan,
    Computed,
    PlannedTensor,
    SourceFile,
    StoredBytes,
    closed_on_failure,
)

# Distinct rank-file layouts kept as templates (a regular checkpoint has a few: full, uneven, empty shards).
_MAX_TEMPLATES = 8
# Distinct zip layouts kept: rank files differ in their names' digits and pickled ranks' widths, times the above.
_MAX_LAYOUTS = 16
MODEL_FILE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
FSDP_CONFIG = "fsdp_config.json"


def is_fsdp_dir(role_dir: Path) -> bool:
    return any(MODEL_FILE.match(p.name) for p in role_dir.iterdir())


@dataclass(frozen=True, slots=True)
class RankShard:
    """One rank's piece of one tensor: where it sits in the global tensor and where its bytes are.

    Small on purpose (a plan holds one per tensor and rank): a contiguous piece keeps only its file
    range; the unpickled meta view is kept only for a strided one, which must be read through it."""

    rank: int
    file: SourceFile
    offset: tuple[int, ...]  # position of the piece in the global tensor
    shape: tuple[int, ...]
    dtype: torch.dtype
    run: ByteRun | None  # the piece's bytes, when contiguous
    strided: StoredTensor | None  # otherwise

    @classmethod
    def of(cls, rank: int, file: SourceFile, stored: StoredTensor, offset: tuple[int, ...]) -> RankShard:
        run = stored.byte_run(file)
        meta = stored.meta
        return cls(rank, file, offset, tuple(meta.shape), meta.dtype, run, None if run is not None else stored)


def plan_fsdp(role_dir: Path, *, verify_replicas: bool = False) -> CheckpointPlan:
    world_size, fsdp_version = _world_size(role_dir)
    paths = [role_dir / f"model_world_size_{world_size}_rank_{r}.pt" for r in range(world_size)]
    files: list[SourceFile] = []
    with closed_on_failure(files):
        # One rank file at a time: its metadata is checked and reduced to where each piece lies, and the
        # unpickled state dropped, so planning memory does not hold every rank's DTensors at once.
        reference: dict[str, torch.Tensor] = {}
        ranks: list[_VerifiedRank | _TemplatedRank] = []
        irregular: set[str] = set()  # laid out unlike rank 0's: their tiling is checked piece by piece
        mesh: dict[str, object] = {}
        templates: list[RankTemplate] = []  # verified rank files others may match byte for byte
        layouts: list[ArchiveLayout] = []  # zip layouts of parsed rank files, to locate others' records by
        starts: dict[int, dict] = {}  # storage offsets of the ranks of one layout and template (_by_layout)
        for rank, path in enumerate(paths):
            files.append(SourceFile(path))
            located, templated = _by_layout(layouts, templates, rank, files[rank], starts)
            if templated is None:
                with torch_archive(path) as archive:
                    templated = _templated(templates, archive.pickled, rank, files[rank], archive.storage_offset)
                    state = archive.state_dict() if templated is None else {}
                    if not located and len(layouts) < _MAX_LAYOUTS and (layout := ArchiveLayout.of(archive)):
                        layouts.insert(0, layout)
            if templated is not None:
                ranks.append(templated)
                continue
            if rank == 0:
                reference = state
                mesh = _mesh_info(state, world_size)
            _check_keys(files[rank], state, reference)
            coordinates = _Coordinates(rank, world_size, files[rank].path)
            verified = []
            for name, value in state.items():
                verified.append(_rank_shard(name, rank, files[rank], value, reference[name], coordinates))
                if rank and not _same_layout(value, reference[name]):
                    irregular.add(name)
            ranks.append(_VerifiedRank(files[rank], verified))
            if len(templates) < _MAX_TEMPLATES and (template := RankTemplate.of(archive, state, rank)) is not None:
                templates.append(template)
            del state
        alike = _alike(ranks)
        tensors = coalesced(
            [
                _planned(name, index, first, ranks, alike, verify_replicas, name in irregular)
                for index, (name, first) in enumerate(reference.items())
            ]
        )
    lora = None
    if (role_dir / LORA_META).exists():
        lora = read_lora_meta(role_dir / LORA_META)
    return CheckpointPlan(
        backend="fsdp",
        role_dir=role_dir,
        hf_dir=role_dir / "huggingface",
        tensors=tensors,
        files=files,
        is_value_model=has_value_head(t.name for t in tensors),
        lora=lora,
        check_against_architecture=False,
        layout={"world_size": world_size, "fsdp_version": fsdp_version, **mesh},
    )


def _by_layout(layouts: list[ArchiveLayout], templates: list[RankTemplate], rank: int, file: SourceFile, shared: dict):
    """(whether the file is laid out as an already parsed one -- ``ArchiveLayout``, then moved to the front:
    neighbouring ranks share theirs --, the rank if so and its pickle is a template's with this rank's
    numbers, else ``None``), from a few reads. ``shared``: storage offsets by layout and template, one
    dict for all ranks of a layout."""
    with file.opened():  # one open for all the reads
        for index, layout in enumerate(layouts):
            if (records := layout.locate(file, file.path.stem)) is not None:
                layouts.insert(0, layouts.pop(index))
                break
        else:
            return False, None
        if (order := records.get("byteorder")) is not None and file.pread(order[1], order[0]) != b"little":
            return True, None  # the full way names the problem
        pickled = file.pread(records["data.pkl"][1], records["data.pkl"][0])

    def located(key: str, numel: int, dtype: torch.dtype) -> int | None:
        found = records.get(f"data/{key}")
        return found[0] if found is not None and found[1] == numel * dtype.itemsize else None

    return True, _templated(templates, pickled, rank, file, located, shared.setdefault(id(records), {}))


def _templated(templates: list[RankTemplate], pickled: bytes, rank: int, file: SourceFile, locate, shared=None):
    """The rank, if its pickle is a template's with this rank's numbers and each local shape the one
    ``torch.chunk`` gives this rank; else ``None`` (the file is then unpickled and fully checked).
    ``locate(key, numel, dtype)``: where the file's storage record ``key`` starts (``RankTemplate.storage_offsets``)."""
    for template in templates:
        if template.matches(pickled, rank) and template.fits(rank):
            starts = shared.get(id(template)) if shared is not None else None
            if starts is None and (starts := template.storage_offsets(locate)) is not None and shared is not None:
                shared[id(template)] = starts
            return None if starts is None else _TemplatedRank(rank, file, template, starts)
    return None


@dataclass(frozen=True, slots=True)
class _VerifiedRank:
    """A rank file unpickled and checked: its pieces, in the state dict's order."""

    file: SourceFile
    shards: list[RankShard]

    def shard(self, index: int) -> RankShard:
        return self.shards[index]

    def run(self, index: int) -> ByteRun | None:
        return self.shards[index].run

    def contiguous(self, index: int) -> bool:
        return self.shards[index].run is not None


@dataclass(frozen=True, slots=True)
class _TemplatedRank:
    """A rank file matched to a template: its pieces are the template's, at this file's storage offsets
    (shared by the ranks of one zip layout), made when asked for -- a plan holds no object per piece."""

    rank: int
    file: SourceFile
    template: RankTemplate
    starts: dict[str, int]

    def shard(self, index: int) -> RankShard:
        t = self.template.tensors[index]
        if t.run is None:  # strided: read through its view, as the full path does
            return RankShard.of(self.rank, self.file, StoredTensor(t.meta, self.starts[t.key]), t.offset(self.rank))
        return RankShard(self.rank, self.file, t.offset(self.rank), t.shape, t.meta.dtype, self.run(index), None)

    def run(self, index: int) -> ByteRun | None:
        t = self.template.tensors[index]
        return None if t.run is None else ByteRun(self.file, self.starts[t.key] + t.run[0], t.run[1])

    def contiguous(self, index: int) -> bool:
        return self.template.tensors[index].run is not None


def _alike(
    ranks: list[_VerifiedRank | _TemplatedRank],
) -> list[tuple[tuple[SourceFile, ...], _VerifiedRank | _TemplatedRank]]:
    """The ranks in runs whose pieces lie at the same offsets of their files (neighbouring ranks of one
    template and zip layout), each run with one of its ranks to ask where; an unpickled rank is a run of one."""
    runs: list[tuple[list[SourceFile], _VerifiedRank | _TemplatedRank]] = []
    for rank in ranks:
        last = runs[-1][1] if runs else None
        if (
            isinstance(rank, _TemplatedRank)
            and isinstance(last, _TemplatedRank)
            and rank.template is last.template
            and rank.starts == last.starts
        ):
            runs[-1][0].append(rank.file)
        else:
            runs.append(([rank.file], rank))
    return [(tuple(files), rank) for files, rank in runs]


def _world_size(role_dir: Path) -> tuple[int, int | None]:
    """World size from fsdp_config.json when present, else from the file names; files must agree."""
    found: dict[int, set[int]] = {}
    for p in role_dir.iterdir():
        if m := MODEL_FILE.match(p.name):
            found.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    if not found:
        raise MergeError(role_dir, "no model_world_size_*_rank_*.pt files: not an FSDP checkpoint folder")
    version = None
    config_path = role_dir / FSDP_CONFIG
    if config_path.exists():
        config = read_json_object(config_path)
        world_size = config.get("world_size")
        if not isinstance(world_size, int) or world_size < 1:
            raise MergeError(config_path, f"'world_size' must be a positive integer, found {world_size!r}")
        version = config.get("FSDP_version")
        if world_size not in found:
            raise MergeError(
                config_path, f"says world_size {world_size} but the rank files are for world size {sorted(found)}"
            )
    elif len(found) == 1:
        world_size = next(iter(found))
    else:
        raise MergeError(role_dir, f"rank files for several world sizes {sorted(found)} and no {FSDP_CONFIG} to choose")
    extra = sorted(
        f"model_world_size_{w}_rank_{r}.pt"
        for w, ranks in found.items()
        for r in ranks
        if w != world_size or r >= world_size
    )
    if extra:
        raise MergeError(role_dir / extra[0], f"unexpected rank file for world size {world_size}")
    missing = sorted(set(range(world_size)) - found[world_size])
    if missing:
        raise MergeError(
            role_dir / f"model_world_size_{world_size}_rank_{missing[0]}.pt",
            f"missing ({len(missing)} of {world_size} rank files missing)",
        )
    return world_size, version


def _check_keys(file: SourceFile, state: dict, reference: dict) -> None:
    if list(state) != list(reference):
        diff = sorted(set(state) ^ set(reference))
        raise MergeError(
            file.path,
            f"holds different keys than rank 0 (e.g. {diff[:3]})" if diff else "keys in a different order than rank 0",
        )


def _mesh_info(state: dict, world_size: int) -> dict[str, object]:
    """How rank 0's first DTensor is laid out (for ``inspect`` and the manifest)."""
    first = next((v for v in state.values() if isinstance(v, DTensor)), None)
    if first is None:
        return {"mesh_shape": [1]} if world_size == 1 else {}
    return {
        "mesh_shape": list(first.device_mesh.shape),
        "mesh_dim_names": list(first.device_mesh.mesh_dim_names or ()),
        "placements": [str(p) for p in first.placements],
    }


class _Coordinates:
    """A rank file's mesh coordinate, checked once per mesh it holds (its tensors share one or two)."""

    def __init__(self, rank: int, world_size: int, path: Path):
        self.rank, self.world_size, self.path = rank, world_size, path
        self.checked: dict[int, tuple[int, ...]] = {}  # id(mesh) -> coordinate

    def of(self, name: str, mesh) -> tuple[int, ...]:
        if (coordinate := self.checked.get(id(mesh))) is not None:
            return coordinate
        if mesh.size() != self.world_size:
            raise MergeError(
                self.path, f"{name}: device mesh of {mesh.size()} ranks in a world-size-{self.world_size} checkpoint"
            )
        expected = tuple(int(c) for c in torch.unravel_index(torch.tensor(self.rank), tuple(mesh.shape)))
        coord = mesh.get_coordinate()
        if coord is None or tuple(coord) != expected:
            raise MergeError(
                self.path,
                f"{name}: shard was saved at mesh coordinate {coord}, but this file's rank {self.rank} is coordinate {expected} (rank files swapped or renamed?)",
            )
        self.checked[id(mesh)] = expected
        return expected


def _rank_shard(name, rank: int, f: SourceFile, value, first, coordinates: _Coordinates) -> RankShard:
    """Check one rank's value of ``name`` against rank 0's (``first``); where its piece lies."""
    if not isinstance(first, torch.Tensor):
        raise MergeError(f.path, f"{name}: expected a tensor, found {type(first).__name__}")
    if not isinstance(first, DTensor):
        if coordinates.world_size != 1:
            raise MergeError(
                f.path,
                f"{name}: plain tensor in a world-size-{coordinates.world_size} checkpoint (expected DTensor shards)",
            )
        return RankShard.of(0, f, stored_tensor(f.path, name, value, f.size), (0,) * value.dim())
    global_shape = tuple(first.shape)
    if not isinstance(value, DTensor):
        raise MergeError(f.path, f"{name}: expected a DTensor shard, found {type(value).__name__}")
    if tuple(value.shape) != global_shape or value.dtype != first.dtype:
        raise MergeError(
            f.path,
            f"{name}: global shape/dtype {tuple(value.shape)}/{value.dtype} differs from rank 0's {global_shape}/{first.dtype}",
        )
    mesh = value.device_mesh
    coordinate = coordinates.of(name, mesh)
    offset, local_shape = _local_region(global_shape, mesh.shape, value.placements, coordinate, f.path, name)
    local = value._local_tensor
    if local.dtype != value.dtype:
        raise MergeError(
            f.path, f"{name}: local shard is stored as {local.dtype} but the DTensor declares {value.dtype}"
        )
    if tuple(local.shape) != local_shape:
        raise MergeError(
            f.path,
            f"{name}: local shard has shape {tuple(local.shape)}, expected {local_shape} for placements {value.placements}",
        )
    return RankShard.of(rank, f, stored_tensor(f.path, name, local, f.size), offset)


def _same_layout(value, first) -> bool:
    """Placed like rank 0's value on a mesh of the same shape. Each rank's piece is where torch.chunk puts
    its (checked) mesh coordinate, so the pieces of such a tensor tile it by construction."""
    if not isinstance(value, DTensor):
        return not isinstance(first, DTensor)
    return value.placements == first.placements and value.device_mesh.shape == first.device_mesh.shape


def _local_region(global_shape, mesh_shape, placements, coord, path, name):
    """Offset and shape of this coordinate's piece: torch.chunk-style splits, applied per mesh dim."""
    offset = [0] * len(global_shape)
    size = list(global_shape)
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is not Shard:
            raise MergeError(path, f"{name}: unsupported placement {placement!r} (only Shard(d) and Replicate)")
        d = placement.dim
        n, parts, index = size[d], mesh_shape[mesh_dim], coord[mesh_dim]
        chunk = -(-n // parts)  # ceil: torch.chunk gives every piece this many rows but the last ones
        start = min(index * chunk, n)
        offset[d] += start
        size[d] = max(0, min(chunk, n - start))
    return tuple(offset), tuple(size)


def _planned(
    name, index: int, first, ranks: list, alike: list, verify_replicas: bool, irregular: bool
) -> PlannedTensor:
    """Rank 0's ``first`` (a DTensor, or a plain tensor) planned from every rank's piece of it."""
    global_shape, dtype = tuple(first.shape), first.dtype
    regular = not (irregular or verify_replicas or 0 in global_shape) and isinstance(first, DTensor)
    if regular and first.placements == (Shard(0),) and all(rank.contiguous(index) for _, rank in alike):
        return PlannedTensor(name, global_shape, dtype, _RankRuns(alike, index, dtype))
    return _assemble(name, global_shape, dtype, [rank.shard(index) for rank in ranks], verify_replicas, irregular)


@dataclass(frozen=True)
class _RankRuns:
    """A ``Shard(0)`` tensor placed alike on every rank: its row-major bytes are each rank's
    ``torch.chunk`` piece in rank order (empty ones skipped), made into file ranges only when read:
    one block per run of ranks whose pieces lie at the same offsets (``_alike``)."""

    alike: list[tuple[tuple[SourceFile, ...], _VerifiedRank | _TemplatedRank]]
    index: int  # the tensor's place in every rank's state dict
    dtype: torch.dtype

    def run_blocks(self) -> list[RunBlock]:
        return [
            RunBlock(files, run.offset, run.length)
            for files, rank in self.alike
            if (run := rank.run(self.index)).length
        ]

    def byte_runs(self) -> list[ByteRun]:
        return [ByteRun(file, block.offset, block.length) for block in self.run_blocks() for file in block.files]

    def pieces(self):
        return StoredBytes(tuple(self.byte_runs()), self.dtype).pieces()


def _assemble(name, global_shape, dtype, shards: list[RankShard], verify_replicas, irregular=True) -> PlannedTensor:
    """Pick one shard per distinct region, check the regions tile the tensor (the check DCP chunks get too)
    unless every rank placed it alike, choose how to read it."""
    regions: dict[tuple, list[RankShard]] = {}
    for s in shards:
        regions.setdefault((s.offset, s.shape), []).append(s)
    if verify_replicas:
        for group in regions.values():
            _check_replicas_equal(name, group)
    pieces = [group[0] for (offset, shape), group in regions.items() if all(shape)]
    if 0 in global_shape:
        return PlannedTensor(name, global_shape, dtype, Computed(lambda: torch.empty(global_shape, dtype=dtype)))
    if irregular:
        boxes = [ChunkStorageMetadata(torch.Size(s.offset), torch.Size(s.shape)) for s in pieces]
        check_tiling(name, global_shape, boxes, shards[0].file.path)
    split_dims = _split_dims(global_shape, pieces)
    if len(split_dims) > 1:  # Shard on several tensor dims, e.g. (Shard(0), Shard(1)) of FSDP x TP
        return PlannedTensor(name, global_shape, dtype, _grid_source(global_shape, dtype, pieces))
    split_dim = split_dims[0] if split_dims else 0
    pieces.sort(key=lambda s: s.offset[split_dim] if global_shape else 0)
    return PlannedTensor(name, global_shape, dtype, _source(global_shape, dtype, pieces, split_dim))


def _split_dims(global_shape, pieces: list[RankShard]) -> list[int]:
    """The dims the pieces are cut on (none when the tensor is whole in one piece)."""
    return sorted({d for s in pieces for d in range(len(global_shape)) if s.shape[d] != global_shape[d]})


def _grid_source(global_shape, dtype, pieces: list[RankShard]) -> Computed:
    """Pieces cut on several dims (their tiling already checked): each is copied into its box."""

    def fill() -> torch.Tensor:
        whole = torch.empty(global_shape, dtype=dtype)
        for s in pieces:
            box = tuple(slice(start, start + length) for start, length in zip(s.offset, s.shape))
            whole[box] = _read_piece(s)
        return whole

    return Computed(fill)


def _source(global_shape, dtype, pieces: list[RankShard], split_dim: int):
    runs = [s.run for s in pieces]
    # Pieces split on dim 0 (or a leading run of size-1 dims) are consecutive row-major bytes.
    if all(r is not None for r in runs) and all(d == 1 for d in global_shape[:split_dim]):
        return StoredBytes(tuple(r for r in runs if r.length), dtype)

    def concatenate() -> torch.Tensor:
        return torch.cat([_read_piece(s) for s in pieces], dim=split_dim)

    return Computed(concatenate)


def _read_piece(s: RankShard) -> torch.Tensor:
    if s.run is not None:
        buffer = bytearray(s.run.length)
        s.file.read_into(memoryview(buffer), s.run.offset)
        flat = torch.frombuffer(buffer, dtype=s.dtype) if s.run.length else torch.empty(0, dtype=s.dtype)
        return flat.view(s.shape)
    meta = s.strided.meta
    item = meta.element_size()
    extent = (meta.storage_offset() + sum((n - 1) * st for n, st in zip(meta.shape, meta.stride())) + 1) * item
    buffer = bytearray(extent)
    s.file.read_into(memoryview(buffer), s.strided.storage_file_offset)
    flat = torch.frombuffer(buffer, dtype=meta.dtype) if extent else torch.empty(0, dtype=meta.dtype)
    return flat.as_strided(meta.shape, meta.stride(), meta.storage_offset()).clone()


def _check_replicas_equal(name, group: list[RankShard]) -> None:
    reference = _read_piece(group[0])
    for s in group[1:]:
        if not torch.equal(_read_piece(s).reshape(-1).view(torch.uint8), reference.reshape(-1).view(torch.uint8)):
            raise MergeError(s.file.path, f"{name}: replica differs from rank {group[0].rank}'s copy of the same shard")


def holds_model_files(step_dir: Path, stack: StepFolder) -> bool:
    """verl's SFT trainer saves its model rank files straight into ``global_step_<N>/``."""
    try:
        with os.scandir(step_dir) as entries:
            return any(MODEL_FILE.match(e.name) for e in entries)
    except OSError:  # deleted meanwhile
        return False


READER = Reader(
    name="fsdp",
    looks_for="an FSDP checkpoint (model_world_size_*_rank_*.pt)",
    detect=is_fsdp_dir,
    plan=lambda role_dir, options, config: plan_fsdp(role_dir, verify_replicas=options.verify_replicas),
    weight_suffixes=(".pt",),
    step_folders=(VERL,),
    saved_in_step_folder=holds_model_files,
    # FSDP leaves no marker of a finished save: verl's tracker or the settle time decides.
)
