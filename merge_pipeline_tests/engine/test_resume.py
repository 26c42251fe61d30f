"""A merge killed (SIGKILL) after some output files were finished, started again: it reuses them and
writes only the rest, bit-identical to an uninterrupted merge; a changed option, or an input re-saved
in place with its mtime put back, starts over; a record naming a sha256 its file does not have gets the
file written again."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from merge_pipeline.engine.publish import staging_path
from merge_pipeline.engine.resume import RECORDS
from merge_pipeline.hf.folder_checks import manifest_problems
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_samples.fsdp_fake_pg import write_fake_pg_checkpoint
from merge_pipeline_tests.helpers import cli_merge_command, tree_digest

pytestmark = pytest.mark.slow

# ~48M parameters (192 MB of fp32 rank files, 96 MB of bf16 output in 6 files): the merge is still
# writing when the test kills it. Written by torch's fake process group (one process, no gloo ranks).
SPEC = FsdpSpec(
    arch="llama",
    world_size=2,
    hidden_size=512,
    intermediate_size=2048,
    num_layers=4,
    vocab_size=32000,
    with_optimizer=False,
)


def _merge_command(role_dir: Path, target: Path, dtype: str = "bfloat16") -> list[str]:
    return cli_merge_command(role_dir, target, "--dtype", dtype, "--max-shard-size", "8MB")


def kill_after(command: list[str], percent: int) -> None:
    """Start the merge (or average) and SIGKILL it as soon as it reports at least ``percent`` of its bytes written."""
    merge = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for line in merge.stderr:
        if (done := re.match(r"writing weights: (\d+)%", line)) and int(done[1]) >= percent:
            merge.send_signal(signal.SIGKILL)
            break
    assert merge.wait() == -signal.SIGKILL, "the merge ended before it could be killed"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    role_dir = tmp_path_factory.mktemp("resume") / "global_step_1" / "actor"
    write_fake_pg_checkpoint(role_dir, SPEC)
    target = role_dir.parents[1] / "uninterrupted"
    subprocess.run(_merge_command(role_dir, target), check=True, capture_output=True)
    return role_dir, target


def test_killed_merge_resumes_with_the_files_it_finished(uninterrupted, tmp_path):
    role_dir, reference = uninterrupted
    target = tmp_path / "out"
    killed_and_resumed(_merge_command(role_dir, target), target, reference)


def killed_and_resumed(command: list[str], target: Path, reference: Path) -> None:
    """Kill ``command`` half-way, run it again: the files it finished are kept, the folder equals ``reference``."""
    staging = staging_path(target)
    kill_after(command, percent=50)
    done = sorted(p.name.removesuffix(".json") for p in (staging / RECORDS).glob("*.safetensors.json"))
    inodes = {name: (staging / name).stat().st_ino for name in done}
    assert 1 <= len(done) < len(list(reference.glob("*.safetensors")))

    again = subprocess.run(command, capture_output=True, text=True)

    assert again.returncode == 0, again.stderr
    assert f"({len(done)} of " in again.stderr and "files reused from a killed merge" in again.stderr
    assert {name: (target / name).stat().st_ino for name in done} == inodes  # kept, not written again
    assert tree_digest(target) == tree_digest(reference)  # every file, the manifest included
    assert not (target / RECORDS).exists() and not staging.exists()


def test_a_changed_option_starts_over(uninterrupted, tmp_path):
    role_dir, _ = uninterrupted
    target = tmp_path / "out"
    staging = staging_path(target)
    kill_after(_merge_command(role_dir, target), percent=50)
    done = [p.name.removesuffix(".json") for p in (staging / RECORDS).glob("*.safetensors.json")]
    inodes = {name: (staging / name).stat().st_ino for name in done}

    again = subprocess.run(_merge_command(role_dir, target, dtype="float32"), capture_output=True, text=True)

    assert again.returncode == 0, again.stderr
    assert done and "reused" not in again.stderr
    assert all((target / name).stat().st_ino != inode for name, inode in inodes.items() if (target / name).exists())


def _weights(folder: Path) -> dict[str, str]:
    return {name: digest for name, digest in tree_digest(folder).items() if name.endswith(".safetensors")}


def test_an_input_resaved_in_place_with_its_mtime_put_back_starts_over(uninterrupted, tmp_path):
    """Between the kill and the rerun the trainer saves the step again over the same files, as
    ``rsync --inplace --times`` does: same paths, inodes, sizes and mtimes, other bytes.
    Only the ctime tells; reusing the kept files would publish the old save's tensors beside the new one's."""
    old, _ = uninterrupted
    role_dir = tmp_path / "run" / "global_step_1" / "actor"
    shutil.copytree(old, role_dir)
    new = tmp_path / "new" / "global_step_1" / "actor"
    write_fake_pg_checkpoint(new, replace(SPEC, seed=1))
    target = tmp_path / "out"
    command = _merge_command(role_dir, target)
    kill_after(command, percent=50)
    assert any((staging_path(target) / RECORDS).glob("*.safetensors.json"))

    for rank_file in sorted(role_dir.glob("model_world_size_*_rank_*.pt")):
        before, data = rank_file.stat(), (new / rank_file.name).read_bytes()
        assert len(data) == before.st_size and data != rank_file.read_bytes()
        with open(rank_file, "r+b") as f:
            f.write(data)  # in place: the same inode
        os.utime(rank_file, ns=(before.st_atime_ns, before.st_mtime_ns))
        after = rank_file.stat()
        assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    again = subprocess.run(command, capture_output=True, text=True)
    subprocess.run(_merge_command(new, tmp_path / "new_save"), check=True, capture_output=True)

    assert again.returncode == 0, again.stderr
    assert "reused" not in again.stderr
    assert _weights(target) == _weights(tmp_path / "new_save")


def test_a_record_edited_to_name_another_sha256_gets_its_file_written_again(uninterrupted, tmp_path):
    """A resume record edited between the kill and the rerun (its file untouched) names a sha256 no
    byte of the file has: the file is written again, and the manifest names the published bytes' digests
    (before: the edited digest went into the manifest and manifest_sha256 passed)."""
    role_dir, reference = uninterrupted
    target = tmp_path / "out"
    command = _merge_command(role_dir, target)
    kill_after(command, percent=50)
    records = sorted((staging_path(target) / RECORDS).glob("*.safetensors.json"))
    edited = records[0]
    edited.write_text(json.dumps({**json.loads(edited.read_text()), "sha256": "0" * 64}))

    again = subprocess.run(command, capture_output=True, text=True)

    assert again.returncode == 0, again.stderr
    reused = len(records) - 1  # all but the edited one
    assert (f"({reused} of " in again.stderr) if reused else ("reused" not in again.stderr)
    assert manifest_problems(target) == []  # every file hashed: the manifest names the bytes published
    assert tree_digest(target) == tree_digest(reference)
