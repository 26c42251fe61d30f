"""Rank files changed after torch.save wrote them: re-packed by a zip tool, or crafted.

A file ``torch.load`` reads correctly merges bit for bit; anything else is refused with one line
naming the file, before any allocation sized by what the file claims.
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
import zipfile

import pytest
import torch
from safetensors.torch import load_file

from merge_pipeline.sample_checkpoints.fsdp import FsdpSpec
from merge_pipeline_tests.helpers import error_lines, load_safetensors_dir, run_cli, same_bits, tree_digest

SPEC = FsdpSpec(world_size=3, with_optimizer=False)  # rank 0 holds 335 of the 1003 embedding rows
# In rank 0's pickle, the first storage reference is model.embed_tokens.weight's local shard:
# storage "0" of 335 x 64 = 21440 floats, then storage offset 0, size (335, 64), stride (64, 1).
EMBED_NUMEL = b"M\xc0\x53t"
EMBED_VIEW = re.compile(rb"QK\x00M\x4f\x01K@\x86(q.)K@K\x01\x86", re.DOTALL)


def rank_file(role_dir, rank=0):
    return role_dir / f"model_world_size_3_rank_{rank}.pt"


def repack(
    path,
    *,
    compression=zipfile.ZIP_STORED,
    reverse=False,
    extra_fields=False,
    edit=lambda name, data: data,
    keep=lambda name: True,
):
    """Rewrite a torch.save archive with Python's zipfile, as a user's zip tool would."""
    with zipfile.ZipFile(path) as source:
        members = [
            (info.filename, edit(info.filename, source.read(info))) for info in source.infolist() if keep(info.filename)
        ]
    if reverse:
        members.reverse()
    with zipfile.ZipFile(path, "w", compression) as target:
        for i, (name, data) in enumerate(members):
            info = zipfile.ZipInfo(name)
            info.compress_type = compression
            if extra_fields:  # a different extra-field length per record moves every data offset
                info.extra = struct.pack("<HH", 0xCAFE, 3 * i) + bytes(3 * i)
            target.writestr(info, data)


def edit_pickle(change):
    return lambda name, data: change(data) if name.endswith("/data.pkl") else data


def int4(value):
    return b"J" + struct.pack("<i", value)  # pickle BININT


def deflated(d):
    repack(rank_file(d), compression=zipfile.ZIP_DEFLATED)
    return "compressed record"


def big_endian(d):
    repack(rank_file(d), edit=lambda name, data: b"big" if name.endswith("/byteorder") else data)
    return "only little-endian"


def storage_larger_than_record(d):
    repack(rank_file(d), edit=edit_pickle(lambda p: p.replace(EMBED_NUMEL, int4(2**30) + b"t", 1)))
    return "holds 85760 bytes but the pickle declares 1073741824"


def absurd_stride(d):
    # (335, 64) with a row stride of 2**20 elements: a 1.4 GB reach into an 84 KB storage.
    repack(
        rank_file(d),
        edit=edit_pickle(
            lambda p: EMBED_VIEW.sub(lambda m: b"QK\x00M\x4f\x01K@\x86" + m[1] + int4(2**20) + b"K\x01\x86", p, 1)
        ),
    )
    return "reaches element"


def huge_shape(d):
    repack(
        rank_file(d),
        edit=edit_pickle(
            lambda p: EMBED_VIEW.sub(lambda m: b"QK\x00" + int4(2**24) + b"K@\x86" + m[1] + b"K@K\x01\x86", p, 1)
        ),
    )
    return "tensor view (shape (16777216, 64), stride (64, 1), offset 0) reaches element 1073741823 but its storage data/0 holds 21440"


def storage_dtype_disagrees(d):
    # Every DTensor now declares bfloat16 while its local shard's storage stays float32.
    repack(rank_file(d), edit=edit_pickle(lambda p: p.replace(b"ctorch\nfloat32\n", b"ctorch\nbfloat16\n", 1)))
    return "stored as torch.float32 but the DTensor declares torch.bfloat16"


class RunsShellOnUnpickle:
    def __reduce__(self):
        return (os.system, ("true",))


def refused_global(d):
    state = torch.load(rank_file(d), weights_only=True)
    state["payload"] = RunsShellOnUnpickle()
    torch.save(state, rank_file(d))
    return "refused to unpickle (weights_only=True): the file names the global posix.system, which is not allowed"


CASES = [
    deflated,
    big_endian,
    storage_larger_than_record,
    absurd_stride,
    huge_shape,
    storage_dtype_disagrees,
    refused_global,
]


@pytest.mark.parametrize("corrupt", CASES, ids=[c.__name__ for c in CASES])
def test_hostile_rank_file_is_refused_in_one_line(capsys, tmp_path, fsdp_checkpoint, fresh_copy, corrupt):
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    problem = corrupt(sample.role_dir)
    before = tree_digest(sample.role_dir)

    code, _, err = run_cli(
        capsys, "merge", "--local_dir", sample.role_dir, "--target_dir", tmp_path / "out", "--no-progress"
    )

    assert code == 1
    [line] = error_lines(err)
    assert str(rank_file(sample.role_dir)) in line and problem in line, line
    assert "Traceback" not in err and "\x1b" not in err
    assert tree_digest(sample.role_dir) == before and not (tmp_path / "out").exists()


REPACKS = {
    "reordered": {"reverse": True},
    "extra-fields": {"extra_fields": True},
    "both": {"reverse": True, "extra_fields": True},
    "no-byteorder-record": {"keep": lambda name: not name.endswith("/byteorder")},  # older torch: little-endian
}


@pytest.mark.parametrize("repack_options", REPACKS.values(), ids=list(REPACKS))
def test_repacked_stored_archive_merges_bit_exact(capsys, tmp_path, fsdp_checkpoint, fresh_copy, repack_options):
    """Offsets come from each record's own local header, not from torch's writer layout."""
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    for rank in range(3):
        repack(rank_file(sample.role_dir, rank), **repack_options)

    code, _, err = run_cli(
        capsys, "merge", "--local_dir", sample.role_dir, "--target_dir", tmp_path / "out", "--no-progress"
    )

    assert code == 0, err
    merged = load_safetensors_dir(tmp_path / "out")
    reference = load_file(sample.reference_dir / "model.safetensors")
    assert set(merged) == set(reference)
    for name, tensor in reference.items():
        assert same_bits(merged[name], tensor), name


PEAK_RSS_OF_A_MERGE = """
import sys
from merge_pipeline.cli import main
from merge_pipeline.pipeline import peak_rss_bytes
code = main(sys.argv[1:])
print("peak_rss_bytes", peak_rss_bytes())
sys.exit(code)
"""


@pytest.mark.parametrize("corrupt", [absurd_stride, storage_larger_than_record], ids=lambda c: c.__name__)
def test_crafted_sizes_allocate_nothing(tmp_path, fsdp_checkpoint, fresh_copy, corrupt):
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    corrupt(sample.role_dir)
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            PEAK_RSS_OF_A_MERGE,
            "merge",
            "--local_dir",
            sample.role_dir,
            "--target_dir",
            tmp_path / "out",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 1, run.stderr
    peak = int(run.stdout.split("peak_rss_bytes")[1])
    assert peak < 1024**3, f"peak RSS {peak / 2**20:.0f} MiB"


@pytest.mark.parametrize("name", ["fsdp_config.json", "huggingface/config.json"])
def test_deeply_nested_json_is_one_line(capsys, tmp_path, fsdp_checkpoint, fresh_copy, name):
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    (sample.role_dir / name).write_text("[" * 100_000 + "]" * 100_000)
    code, _, err = run_cli(
        capsys, "merge", "--local_dir", sample.role_dir, "--target_dir", tmp_path / "out", "--no-progress"
    )
    assert code == 1 and "Traceback" not in err
    [line] = error_lines(err)
    assert f"{sample.role_dir / name}: JSON nested too deeply" in line, line
