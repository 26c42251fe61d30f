"""Rank files checked by bytes against a verified one (formats/fsdp/rank_template.py), and small pieces read
a group of tensors at a time (formats/coalesced_reads.py).

World size 16 written by torch's fake process group: 40 embedding rows are 3 per rank on ranks 0-12,
1 on rank 13 and none on 14-15, so there are full, uneven and empty shards, each pattern planned
from one unpickled rank file; every other rank file must be that file's pickle but for its own rank.
A file differing anywhere else is unpickled and verified as before, and refused where it is wrong.
"""

from __future__ import annotations

import dataclasses
import gc
import re
import shutil
import zipfile
from pathlib import Path

import pytest
import safetensors.torch
import torch

from merge_pipeline.engine import safetensors_writer
from merge_pipeline.formats import coalesced_reads
from merge_pipeline.formats.fsdp.archive_layouts import ArchiveLayout
from merge_pipeline.formats.fsdp.rank_template import RankTemplate
from merge_pipeline.formats.fsdp.reader import RankShard, plan_fsdp
from merge_pipeline.formats.torch_files import torch_archive
from merge_pipeline.plan import SourceFile
from merge_pipeline.store import sources
from merge_pipeline_samples.fsdp_fake_pg import write_fake_pg_checkpoint
from merge_pipeline_tests.formats.fsdp.test_fsdp_hostile_files import edit_pickle, repack
from merge_pipeline_tests.formats.fsdp.test_fsdp_world_size import SPEC as WORLD_SIZE_SPEC
from merge_pipeline_tests.helpers import error_lines, load_safetensors_dir, run_cli, same_bits, tree_digest

WORLD_SIZE = 16
SPEC = dataclasses.replace(WORLD_SIZE_SPEC, world_size=WORLD_SIZE, vocab_size=40)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("templates")
    write_fake_pg_checkpoint(root / "global_step_1" / "actor", SPEC, reference_dir=root / "reference")
    return root


@pytest.fixture
def checkpoint(written, tmp_path):
    shutil.copytree(written, tmp_path / "copy")
    return tmp_path / "copy" / "global_step_1" / "actor", load_safetensors_dir(tmp_path / "copy" / "reference")


def rank_file(role_dir, rank):
    return role_dir / f"model_world_size_{WORLD_SIZE}_rank_{rank}.pt"


def template_of(role_dir, rank):
    with torch_archive(rank_file(role_dir, rank)) as archive:
        return RankTemplate.of(archive, archive.state_dict(), rank)


def matches(template, role_dir, rank, as_rank=None):
    with torch_archive(rank_file(role_dir, rank)) as archive:
        return template.matches(archive.pickled, rank if as_rank is None else as_rank)


def test_a_rank_file_matches_a_template_only_with_its_own_rank_and_shapes(checkpoint):
    role_dir, _ = checkpoint
    full = template_of(role_dir, 0)

    assert full is not None
    assert all(matches(full, role_dir, rank) for rank in range(1, 13))  # 3 rows each, as rank 0
    assert not matches(full, role_dir, 5, as_rank=6)  # a rank's file is not another rank's
    assert not any(matches(full, role_dir, rank) for rank in (13, 14, 15))  # uneven, empty: other shapes
    assert matches(template_of(role_dir, 14), role_dir, 15)  # both empty


def assert_merges_bit_exact(role_dir, expected):
    with plan_fsdp(role_dir) as plan:
        got = {t.name: t.load() for t in plan.tensors}
    assert got.keys() == expected.keys()
    assert all(same_bits(got[name], expected[name]) for name in expected)


def test_templated_and_grouped_plan_is_bit_exact(checkpoint):
    role_dir, expected = checkpoint
    assert_merges_bit_exact(role_dir, expected)


def test_a_repacked_rank_file_is_read_from_its_own_zip_records(checkpoint):
    # Same pickle (so it matches rank 0's template), every record moved by extra fields.
    role_dir, expected = checkpoint
    repack(rank_file(role_dir, 7), extra_fields=True)
    assert_merges_bit_exact(role_dir, expected)


def other_rank(role_dir):
    shutil.copyfile(rank_file(role_dir, 3), rank_file(role_dir, 5))
    return "mesh coordinate (3,), but this file's rank 5 is coordinate (5,)"


def storage_larger_than_record(role_dir):
    # Rank 4's pickle with one more byte changed than its rank: the first storage declares 255 floats.
    def grow(data):
        at = data.index(b"X\x01\x00\x00\x000q")  # the first storage key "0", memo put, "cpu", memo put, numel
        return data[: at + 18] + b"K\xff" + data[at + 20 :]

    repack(rank_file(role_dir, 4), edit=edit_pickle(grow))
    return "storage record data/0 holds 384 bytes but the pickle declares 255 x torch.float32"


@pytest.mark.parametrize("craft", [other_rank, storage_larger_than_record])
def test_a_rank_file_unlike_its_template_is_verified_and_refused(capsys, checkpoint, tmp_path, craft):
    role_dir, _ = checkpoint
    rank = 5 if craft is other_rank else 4
    problem = craft(role_dir)
    before = tree_digest(role_dir)

    code, _, err = run_cli(capsys, "merge", "--local_dir", role_dir, "--target_dir", tmp_path / "out", "--no-progress")

    assert code == 1
    [line] = error_lines(err)
    assert str(rank_file(role_dir, rank)) in line and problem in line, line
    assert tree_digest(role_dir) == before and not (tmp_path / "out").exists()


def zip_layout(role_dir, rank):
    with torch_archive(rank_file(role_dir, rank)) as archive:
        return ArchiveLayout.of(archive)


def records_found(role_dir, rank, layout, name=None):
    path = rank_file(role_dir, rank)
    file = SourceFile(path)
    try:
        return layout.locate(file, name or path.stem)
    finally:
        file.close()


def records_parsed(role_dir, rank):
    """Each record's (data offset, size) as the full way finds them: zipfile's directory, every local header."""
    with torch_archive(rank_file(role_dir, rank)) as archive:
        prefix = archive.prefix + b"/"
        return {
            name.removeprefix(prefix).decode(): (archive.offsets[name], r.file_size)
            for name, r in archive.records.items()
        }


def test_a_zip_layout_locates_each_record_where_the_full_parse_finds_it(checkpoint):
    role_dir, _ = checkpoint
    layout = zip_layout(role_dir, 0)

    # ranks 1-9: rank 0's shapes and a name as long; 10-12 longer names; 13-15 other shapes
    assert [rank for rank in range(WORLD_SIZE) if records_found(role_dir, rank, layout)] == list(range(10))
    assert all(records_found(role_dir, rank, layout) == records_parsed(role_dir, rank) for rank in range(10))
    longer = zip_layout(role_dir, 10)
    assert all(records_found(role_dir, rank, longer) == records_parsed(role_dir, rank) for rank in (11, 12))


def overwrite(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def local_header_time(path):
    # the modification time in the local header of data/0 (no reader uses it, zipfile neither)
    with zipfile.ZipFile(path) as z:
        overwrite(path, z.getinfo(f"{path.stem}/data/0").header_offset + 10, b"\x21\x00")


def directory_attributes(path):
    # the external attributes in the central directory's first entry (zipfile reads them, nothing uses them)
    with zipfile.ZipFile(path) as z:
        overwrite(path, z.start_dir + 38, b"\x01\x00\xa4\x81")


@pytest.mark.parametrize("change", [local_header_time, directory_attributes])
def test_a_rank_file_laid_out_otherwise_by_one_byte_is_parsed_the_full_way(checkpoint, change):
    role_dir, expected = checkpoint
    change(rank_file(role_dir, 3))

    assert records_found(role_dir, 3, zip_layout(role_dir, 0)) is None
    assert_merges_bit_exact(role_dir, expected)  # zipfile reads it: those bytes place nothing


def test_a_zip_layout_needs_the_files_own_name_as_archive_name(checkpoint):
    role_dir, _ = checkpoint
    shutil.copyfile(rank_file(role_dir, 3), rank_file(role_dir, 5))  # same layout, named rank 3 inside

    assert records_found(role_dir, 5, zip_layout(role_dir, 0)) is None
    assert records_found(role_dir, 5, zip_layout(role_dir, 0), name=rank_file(role_dir, 3).stem) is not None


def big_endian(role_dir):
    # Rank 6's byteorder record says "big" (same length, CRC not checked): laid out like rank 0's file.
    path = rank_file(role_dir, 6)
    with zipfile.ZipFile(path) as z:
        record = z.getinfo(f"{path.stem}/byteorder")
    with torch_archive(path) as archive:
        overwrite(path, archive.offsets[record.filename.encode()], b"big\x00\x00\x00")
    return "records are stored 'big\\x00\\x00\\x00'-endian"


def test_a_big_endian_rank_file_laid_out_like_another_is_refused(capsys, checkpoint, tmp_path):
    role_dir, _ = checkpoint
    big_endian(role_dir)
    before = tree_digest(role_dir)

    code, _, err = run_cli(capsys, "merge", "--local_dir", role_dir, "--target_dir", tmp_path / "out", "--no-progress")

    assert code == 1
    [line] = error_lines(err)
    assert str(rank_file(role_dir, 6)) in line and "-endian; only little-endian checkpoints" in line, line
    assert tree_digest(role_dir) == before and not (tmp_path / "out").exists()


def test_a_regular_plan_holds_pieces_only_of_the_rank_files_it_unpickled(checkpoint):
    # Ranks 0 (full shards), 13 (uneven) and 14 (empty) are unpickled; the other 13 match their
    # templates, and their pieces are made only when read: the plan is O(tensors), not O(tensors x ranks).
    role_dir, expected = checkpoint
    before = _rank_shards()  # what earlier tests of this process may still hold: not this plan's
    with plan_fsdp(role_dir) as plan:
        assert _rank_shards() - before == 3 * len(expected)
        assert {t.name: t.load() for t in plan.tensors}.keys() == expected.keys()


def _rank_shards() -> int:
    gc.collect()
    return sum(type(o) is RankShard for o in gc.get_objects())


def bytes_read() -> int:
    return int(re.search(r"rchar: (\d+)", Path("/proc/self/io").read_text())[1])


@pytest.mark.parametrize("order", ["reversed", "second half only"])
def test_a_group_read_out_of_order_or_in_part_reads_each_piece_once(checkpoint, order):
    # A torchrun rank writes its output files biggest first, and its share may start or end inside a
    # group: each member is read at most once, and none before the first one taken.
    role_dir, expected = checkpoint
    with plan_fsdp(role_dir) as plan:
        tensors = plan.tensors[::-1] if order == "reversed" else plan.tensors[len(plan.tensors) // 2 :]
        wanted = sum(t.nbytes() for t in tensors)
        assert len({id(t.source.group) for t in tensors if hasattr(t.source, "group")}) == 1  # all one group
        before = bytes_read()
        got = {t.name: t.load() for t in tensors}
        read = bytes_read() - before
    assert all(same_bits(got[name], expected[name]) for name in got)
    assert wanted <= read < 1.5 * wanted  # the zip headers between the pieces, and nothing twice


def read_calls() -> int:
    return int(re.search(r"syscr: (\d+)", Path("/proc/self/io").read_text())[1])


def test_a_group_is_read_by_one_read_per_rank_file(checkpoint, monkeypatch):
    # What grows with the world size is one read per rank file and group, not one per (tensor, rank):
    # a rank file's pieces of a group's tensors lie together and come in by one preadv.
    monkeypatch.setattr(coalesced_reads, "GROUP_BYTES", 8192)  # several groups of this small model
    role_dir, expected = checkpoint
    with plan_fsdp(role_dir) as plan:
        grouped = [t for t in plan.tensors if isinstance(t.source, coalesced_reads._GroupedBytes)]
        groups = list({id(t.source.group): t.source.group for t in grouped}.values())
        files = [
            {f for m in g.members for b in coalesced_reads.run_blocks(m.source) if b.length for f in b.files}
            for g in groups
        ]
        assert len(groups) > 2 and any(len(g.members) > 2 for g in groups)
        before = read_calls()
        got = {t.name: t.load() for t in grouped}
        reads = read_calls() - before
    assert all(same_bits(got[name], expected[name]) for name in got)
    assert sum(map(len, files)) <= reads <= sum(map(len, files)) + 2  # + reading /proc/self/io


def test_a_tensor_over_more_rank_files_than_descriptors_kept_opens_each_once(checkpoint, monkeypatch, tmp_path):
    # The embedding (40 x 32 fp32, 5120 bytes) is over the group size, so it is read rank file by rank
    # file; with 4 descriptors kept for its 14 rank files, reading it ahead (fadvise) and then reading
    # it opened each file twice (at ws1024: 2 x 1024 opens per such tensor). Now once.
    monkeypatch.setattr(coalesced_reads, "GROUP_BYTES", 4096)
    monkeypatch.setattr(sources._OPEN, "limit", 4)
    monkeypatch.setattr(safetensors_writer, "MAX_OPEN_FILES", 4)
    opened: list[Path] = []
    real_open = sources.LocalFile._open
    monkeypatch.setattr(sources.LocalFile, "_open", lambda f: opened.append(f.path) or real_open(f))
    role_dir, expected = checkpoint
    with plan_fsdp(role_dir) as plan:
        embedding = next(t for t in plan.tensors if t.name == "model.embed_tokens.weight")
        assert embedding.nbytes() > coalesced_reads.GROUP_BYTES
        holding = {run.file.path for run in embedding.source.byte_runs()}
        assert len(holding) == 14  # ranks 14 and 15 hold no rows
        opened.clear()
        output = [safetensors_writer.OutputTensor(embedding, torch.bfloat16)]
        safetensors_writer.write_safetensors(tmp_path / "out.safetensors", output)
    assert sorted(opened) == sorted(holding)  # each once
    got = safetensors.torch.load_file(tmp_path / "out.safetensors")["model.embed_tokens.weight"]
    assert same_bits(got, expected["model.embed_tokens.weight"].to(torch.bfloat16))
