"""Rank files changed after torch.save wrote them: re-packed by a zip tool, or crafted.

A file ``torch.load`` reads correctly merges bit for bit; anything else is refused with one line
naming the file, before any allocation sized by what the file claims.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import socket
import struct
import subprocess
import sys
import time
import zipfile

import psutil
import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.tensor import Shard

from merge_pipeline_samples.fsdp import FsdpSpec
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


def assert_refused(capsys, tmp_path, role_dir, problem):
    """The merge fails with one line naming rank 0's file and ``problem``; nothing written, nothing changed."""
    before = tree_digest(role_dir)

    code, _, err = run_cli(capsys, "merge", "--local_dir", role_dir, "--target_dir", tmp_path / "out", "--no-progress")

    assert code == 1
    [line] = error_lines(err)
    assert str(rank_file(role_dir)) in line and problem in line, line
    assert "Traceback" not in err and "\x1b" not in err
    assert tree_digest(role_dir) == before and not (tmp_path / "out").exists()


@pytest.mark.parametrize("corrupt", CASES, ids=[c.__name__ for c in CASES])
def test_hostile_rank_file_is_refused_in_one_line(capsys, tmp_path, fsdp_checkpoint, fresh_copy, corrupt):
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    assert_refused(capsys, tmp_path, sample.role_dir, corrupt(sample.role_dir))


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


# ---- Hostile round 3: read as torch.load reads the file, or refused; the pickle builds a state dict only


def test_a_legacy_stream_with_a_zip_appended_is_refused(capsys, tmp_path, fsdp_checkpoint, fresh_copy):
    """torch.load reads a file that does not start with a zip record as a pre-1.6 stream; zipfile finds the
    zip appended after it. Both read it, other weights each: the merge refuses it."""
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    path = rank_file(sample.role_dir)
    legacy = io.BytesIO()
    torch.save({"model.embed_tokens.weight": torch.zeros(3)}, legacy, _use_new_zipfile_serialization=False)
    path.write_bytes(legacy.getvalue() + path.read_bytes())
    assert torch.load(path, weights_only=True)["model.embed_tokens.weight"].shape == (3,) and zipfile.is_zipfile(path)

    assert_refused(capsys, tmp_path, sample.role_dir, "does not start with a zip record")


# As UTF-8, "├ç" is e2 94 9c c3 a7; the bytes c3 87, in a name without zip's UTF-8 flag, are "├ç" in cp437.
TWO_WAY_KEY = "├ç"


def names_decoded_two_ways(path):
    """Rank 0's embedding storage ``data/0`` renamed to the bytes ``data/\xc3\x87`` (no UTF-8 flag), a record
    named by the UTF-8 bytes of ``data/├ç`` holding the embedding negated, and the pickle asking for ``data/├ç``.
    Returns the local shard torch.load reads."""
    prefix = f"{path.stem}/data/"
    with zipfile.ZipFile(path) as z:
        members = [(info.filename, z.read(info)) for info in z.infolist()]
    embed = dict(members)[prefix + "0"]
    negated = torch.frombuffer(bytearray(embed), dtype=torch.float32).neg()
    members = [(prefix + "@@" if name == prefix + "0" else name, data) for name, data in members]
    members.append((prefix + "@@@@@", negated.numpy().tobytes()))
    key = b"X" + struct.pack("<I", len(TWO_WAY_KEY.encode())) + TWO_WAY_KEY.encode()
    members = [(n, d.replace(b"X\x01\x00\x00\x000", key, 1) if n.endswith("/data.pkl") else d) for n, d in members]
    with zipfile.ZipFile(path, "w") as target:  # ASCII placeholders: written without the UTF-8 flag
        for name, data in members:
            target.writestr(zipfile.ZipInfo(name), data)
    raw = (
        path.read_bytes()
        .replace(b"/data/@@@@@", b"/data/" + TWO_WAY_KEY.encode())
        .replace(b"/data/@@", b"/data/\xc3\x87")
    )
    path.write_bytes(raw)
    read = torch.load(path, weights_only=True)["model.embed_tokens.weight"]._local_tensor
    assert same_bits(read.flatten(), negated)  # torch reads the record named by the key's UTF-8 bytes
    return read


def test_record_names_are_compared_as_bytes_as_torch_compares_them(capsys, tmp_path, fsdp_checkpoint, fresh_copy):
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    torch_reads = names_decoded_two_ways(rank_file(sample.role_dir))

    code, _, err = run_cli(
        capsys, "merge", "--local_dir", sample.role_dir, "--target_dir", tmp_path / "out", "--no-progress"
    )

    assert code == 0, err
    merged = load_safetensors_dir(tmp_path / "out")["model.embed_tokens.weight"]
    assert same_bits(merged[:335], torch_reads)  # what torch.load reads, not the record zipfile would name
    reference = load_file(sample.reference_dir / "model.safetensors")["model.embed_tokens.weight"]
    assert same_bits(merged[335:], reference[335:])


def add_record(path, name, data=b""):
    with zipfile.ZipFile(path, "a") as z:
        z.writestr(zipfile.ZipInfo(name), data)


def no_version_record(d):
    repack(rank_file(d), keep=lambda name: not name.endswith("/version"))
    return "torch.load's zip reader refuses it: "


def unsupported_version(d):
    repack(rank_file(d), edit=lambda name, data: b"99\n" if name.endswith("/version") else data)
    return "torch.load's zip reader refuses it: "


def torchscript_constants(d):
    add_record(rank_file(d), f"{rank_file(d).stem}/constants.pkl")
    return "a TorchScript archive (it holds constants.pkl)"


def record_outside_the_archive_folder(d):
    add_record(rank_file(d), "elsewhere/notes.txt")
    return "record elsewhere/notes.txt is outside the archive folder"


def storage_alignment_not_a_number(d):
    repack(rank_file(d), edit=lambda name, data: b"sixty-four" if name.endswith("/.storage_alignment") else data)
    return "its .storage_alignment record is not a number"


def bytes_before_the_archive(d):
    # zipfile reads the archive after them (offsets shifted by its "concat"); torch's reader takes offsets as they are
    rank_file(d).write_bytes(b"PK\x03\x04" + bytes(60) + rank_file(d).read_bytes())
    return "torch.load's zip reader refuses it: "


def negative_stride(d):
    # (335, 64) with stride (64, -1): torch's set_ refuses it; on the meta device it became (64, 1)
    repack(rank_file(d), edit=edit_pickle(lambda p: EMBED_VIEW.sub(lambda m: m[0][:-3] + int4(-1) + b"\x86", p, 1)))
    return "_rebuild_tensor_v2 called with (TypedStorage, int, tuple of 2, tuple of 2, bool, OrderedDict)"


TORCH_REFUSES = [
    no_version_record,
    unsupported_version,
    torchscript_constants,
    record_outside_the_archive_folder,
    storage_alignment_not_a_number,
    bytes_before_the_archive,
    negative_stride,
]


@pytest.mark.filterwarnings("ignore:'torch.load' received a zip file that looks like a TorchScript archive")
@pytest.mark.parametrize("refused_by_torch", TORCH_REFUSES, ids=[c.__name__ for c in TORCH_REFUSES])
def test_a_rank_file_torch_load_refuses_is_refused(capsys, tmp_path, fsdp_checkpoint, fresh_copy, refused_by_torch):
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    problem = refused_by_torch(sample.role_dir)
    with pytest.raises(Exception):  # noqa: B017  (torch refuses each in its own words)
        torch.load(rank_file(sample.role_dir), map_location="cpu", weights_only=True)

    assert_refused(capsys, tmp_path, sample.role_dir, problem)


def prefixed(ops):
    """The rank file's pickle with ``ops`` run first: what they build stays on the stack below the state dict,
    which torch's unpickler (and Python's) return, ignoring the rest."""
    return edit_pickle(lambda p: p[:2] + ops + p[2:])


# BUILD on a class object, with (no dict state, slot state): setattr on the class itself, for the whole process.
CLASS_BUILDS = {
    "TypedStorage.dtype": (
        torch.storage.TypedStorage,
        "dtype",
        b"ctorch.storage\nTypedStorage\nN}X\x05\x00\x00\x00dtypectorch\nfloat16\ns\x86b",
        "the file names the global torch.storage.TypedStorage, which is not allowed",
    ),
    "Shard.dim": (
        Shard,
        "dim",
        b"ctorch.distributed.tensor.placement_types\nShard\nN}X\x03\x00\x00\x00dimK\x07s\x86b",
        "on torch.distributed.tensor.placement_types.Shard: only the objects of a state dict's classes are built",
    ),
}


@pytest.mark.parametrize("cls, attribute, ops, problem", CLASS_BUILDS.values(), ids=list(CLASS_BUILDS))
def test_build_on_a_class_is_refused_and_the_class_is_left_alone(
    capsys, tmp_path, fsdp_checkpoint, fresh_copy, cls, attribute, ops, problem
):
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    repack(rank_file(sample.role_dir), edit=prefixed(ops))
    before = vars(cls).get(attribute)
    with pytest.raises(pickle.UnpicklingError, match="Can only build"):
        torch.load(rank_file(sample.role_dir), weights_only=True)
    try:
        assert_refused(capsys, tmp_path, sample.role_dir, problem)
        assert vars(cls).get(attribute) is before
    finally:  # a reader that ran the BUILD changed the class for every later test of this process
        if vars(cls).get(attribute) is not before:
            setattr(cls, attribute, before) if before is not None else delattr(cls, attribute)


MERGE_REPORTING_PEAK_RSS = """
import sys
from merge_pipeline.cli import main
from merge_pipeline.workers.writing import peak_rss_bytes
code = main(sys.argv[1:])
print("peak_rss_bytes", peak_rss_bytes())
sys.exit(code)
"""
ADDRESS_SPACE = 3 * 1024**3  # a merge of SPEC takes ~1.1 GB of address space (one thread per pool, two arenas)


def capped_merge(role_dir, target, *, env=None, timeout=300):
    """A CLI merge in a child under ``prlimit --as``: (exit code, stderr, peak RSS in bytes, wall seconds)."""
    started = time.monotonic()
    run = subprocess.run(
        ["prlimit", f"--as={ADDRESS_SPACE}", "--", sys.executable, "-c", MERGE_REPORTING_PEAK_RSS, "merge"]
        + ["--local_dir", str(role_dir), "--target_dir", str(target), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2", **(env or {})},
    )
    peak = int(run.stdout.split("peak_rss_bytes")[1]) if "peak_rss_bytes" in run.stdout else -1
    return run.returncode, run.stderr, peak, time.monotonic() - started


def bytearray_prefix(d):
    # 31 bytes: bytearray(3 * 10**9) -- 3 GB of zeros
    repack(rank_file(d), edit=prefixed(b"cbuiltins\nbytearray\n\x8a\x05\x00\x5e\xd0\xb2\x00\x85R"))
    return "refused to unpickle (weights_only=True): the file names the global builtins.bytearray, which is not allowed"


def cpu_tensor_prefix(d):
    # _rebuild_device_tensor_from_cpu_tensor(torch.Tensor(torch.Size((150_000_000,))), torch.float64, "cpu", False):
    # 600 MB of float32, then 1.2 GB of float64
    repack(
        rank_file(d),
        edit=prefixed(
            b"ctorch._utils\n_rebuild_device_tensor_from_cpu_tensor\n(ctorch\nTensor\nctorch\nSize\n"
            + int4(150_000_000)
            + b"\x85\x85R\x85Rctorch\nfloat64\nX\x03\x00\x00\x00cpu\x89tR"
        ),
    )
    return "the global torch._utils._rebuild_device_tensor_from_cpu_tensor, which is not allowed"


def memo_bomb_in_a_storage_reference(d):
    # The first storage key '0' becomes a tuple of two references to a tuple of two ... 40 deep: ~400 bytes whose
    # repr would be 10^12 characters
    bomb = b"X\x01\x00\x00\x00x\x85r" + struct.pack("<I", 100_000)
    for level in range(40):  # the tuple on the stack, paired with itself from the memo
        bomb += b"j" + struct.pack("<I", 100_000 + level) + b"\x86r" + struct.pack("<I", 100_001 + level)
    repack(rank_file(d), edit=edit_pickle(lambda p: p.replace(b"X\x01\x00\x00\x000", bomb, 1)))
    return "malformed storage reference (str, StorageType, tuple, str, int)"


@pytest.mark.slow
@pytest.mark.parametrize(
    "corrupt",
    [bytearray_prefix, cpu_tensor_prefix, memo_bomb_in_a_storage_reference, absurd_stride, storage_larger_than_record],
    ids=lambda c: c.__name__,
)
def test_crafted_sizes_allocate_nothing(tmp_path, fsdp_checkpoint, fresh_copy, corrupt):
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    problem = corrupt(sample.role_dir)

    code, err, peak, _ = capped_merge(sample.role_dir, tmp_path / "out")

    assert code == 1, err
    [line] = error_lines(err)
    assert str(rank_file(sample.role_dir)) in line and problem in line, line
    assert 0 < peak < 1024**3, f"peak RSS {peak / 2**20:.0f} MiB"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_device_mesh_call_in_a_rank_file_opens_no_socket(tmp_path, fsdp_checkpoint, fresh_copy):
    """REDUCE of DeviceMesh("cpu", [0]) ran DeviceMesh.__init__: init_process_group() on the leftover MASTER_*,
    RANK and WORLD_SIZE of a shell, listening on MASTER_PORT for a second rank for 30 minutes."""
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    repack(
        rank_file(sample.role_dir),
        edit=prefixed(b"ctorch.distributed.device_mesh\nDeviceMesh\n(X\x03\x00\x00\x00cpu]K\x00atR"),
    )
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "2"}
    command = [sys.executable, "-m", "merge_pipeline", "merge", "--local_dir", str(sample.role_dir)]
    command += ["--target_dir", str(tmp_path / "out"), "--no-progress"]
    started = time.monotonic()
    child = subprocess.Popen(
        command, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    listening = []
    try:
        watched = psutil.Process(child.pid)
        while child.poll() is None and not listening and time.monotonic() - started < 120:
            with contextlib.suppress(psutil.Error):
                listening = [c.laddr for c in watched.net_connections("inet") if c.status == psutil.CONN_LISTEN]
            time.sleep(0.02)
    finally:
        if child.poll() is None:
            child.kill()
        _, err = child.communicate()
    elapsed = time.monotonic() - started

    assert not listening, f"the merge listens on {listening}"
    assert child.returncode == 1 and elapsed < 120, (child.returncode, elapsed)
    [line] = error_lines(err)
    assert str(rank_file(sample.role_dir)) in line, line
    assert "calls the class torch.distributed.device_mesh.DeviceMesh, which a state dict is never rebuilt with" in line
