"""Where a merge may write, from the command line: never into the input, never over a folder we did
not write, bit-exact on another filesystem, and one line naming the file when the disk is full.

The second filesystem is a real tmpfs mounted for the test (the checkpoints live on the normal disk).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from merge_pipeline.engine.publish import previous_path, staging_path
from merge_pipeline.hf.manifest import MANIFEST
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.helpers import error_lines, load_safetensors_dir, merge, same_bits, tree_digest

SPEC = FsdpSpec(world_size=3, with_optimizer=False)  # 0.8 MB of weights; the same spec as test_fsdp_bad_input


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(size, *options) -> Path``: a fresh tmpfs mounted under ``tmp_path``, unmounted after the test."""
    mounted = []

    def mount(size: str, *options: str) -> Path:
        point = tmp_path / f"tmpfs_{len(mounted)}"
        point.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", ",".join([f"size={size}", *options]), "tmpfs", str(point)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.fail(
                f"these tests need a real second filesystem: mount -t tmpfs failed (run as root): {done.stderr.strip()}"
            )
        mounted.append(point)
        return point

    yield mount
    for point in reversed(mounted):
        subprocess.run(
            ["umount", "--lazy", str(point)], check=True
        )  # lazy: a failed test's traceback may still map a file there


def leftovers(target) -> list[str]:
    """The lock, staging and previous folders beside ``target``."""
    return sorted(p.name for p in target.parent.iterdir() if p.name.startswith(f".{target.name}."))


OVERLAPS = {
    "target_is_the_input": (lambda role: role, ["--overwrite"], "is the input checkpoint"),
    "target_inside_the_input": (lambda role: role / "merged", [], "lies inside the input checkpoint"),
    "target_is_a_folder_of_the_input": (
        lambda role: role / "huggingface",
        ["--overwrite"],
        "lies inside the input checkpoint",
    ),
    "target_contains_the_input": (lambda role: role.parent, ["--overwrite"], "contains the input checkpoint"),
}


@pytest.mark.parametrize("case", OVERLAPS, ids=list(OVERLAPS))
def test_target_overlapping_the_input_deletes_nothing(capsys, tmp_path, fsdp_checkpoint, fresh_copy, case):
    where, flags, problem = OVERLAPS[case]
    role_dir = fresh_copy(fsdp_checkpoint(SPEC)).role_dir  # under tmp_path, with nothing else there
    target = where(role_dir)
    files_before, paths_before = tree_digest(tmp_path), sorted(tmp_path.rglob("*"))

    code, _, err = merge(capsys, role_dir, target, *flags)

    assert code == 1
    assert error_lines(err) == [f"error: {target}: {problem} {role_dir}: choose a --target_dir outside it"]
    assert tree_digest(tmp_path) == files_before, "the input checkpoint must be untouched"
    assert sorted(tmp_path.rglob("*")) == paths_before, "no target, staging or lock created"


def test_overwrite_refuses_a_folder_we_did_not_write(capsys, tmp_path, fsdp_checkpoint):
    target = tmp_path / "results"
    target.mkdir()
    (target / "eval.json").write_text('{"accuracy": 0.71}')
    before = tree_digest(target)

    code, _, err = merge(capsys, fsdp_checkpoint(SPEC).role_dir, target, "--overwrite")

    assert code == 1
    assert error_lines(err) == [
        f"error: {target}: is not empty and has no merge_manifest.json from merge_pipeline: not replaced, even with --overwrite (move it away or choose another --target_dir)"
    ]
    assert tree_digest(target) == before and leftovers(target) == []


def test_overwrite_takes_an_empty_folder(capsys, tmp_path, fsdp_checkpoint):
    (tmp_path / "out").mkdir()
    code, _, err = merge(capsys, fsdp_checkpoint(SPEC).role_dir, tmp_path / "out", "--overwrite")
    assert code == 0, err
    assert (tmp_path / "out" / "merge_manifest.json").is_file()


def test_target_on_another_filesystem_merges_bit_exact(capsys, tmp_path, fsdp_checkpoint, tmpfs):
    sample = fsdp_checkpoint(SPEC)
    other = tmpfs("64m")
    assert os.stat(other).st_dev != os.stat(sample.role_dir).st_dev
    code, _, err = merge(capsys, sample.role_dir, tmp_path / "same_fs", "--max-shard-size", "256KB")
    assert code == 0, err

    code, _, err = merge(capsys, sample.role_dir, other / "out", "--max-shard-size", "256KB")
    assert code == 0, err
    assert tree_digest(other / "out") == tree_digest(tmp_path / "same_fs")
    merged, reference = load_safetensors_dir(other / "out"), load_safetensors_dir(sample.reference_dir)
    assert merged.keys() == reference.keys() and all(same_bits(merged[k], reference[k]) for k in reference)

    code, _, err = merge(
        capsys, sample.role_dir, other / "out", "--max-shard-size", "256KB", "--overwrite"
    )  # the exchange on tmpfs
    assert code == 0, err
    replaced, first = tree_digest(other / "out"), tree_digest(tmp_path / "same_fs")
    assert replaced.pop(MANIFEST) != first.pop(MANIFEST), "the manifest records --overwrite"
    assert replaced == first and leftovers(other / "out") == []


def test_full_disk_is_one_line_naming_the_file_and_keeps_the_good_target(capsys, fsdp_checkpoint, tmpfs):
    role_dir = fsdp_checkpoint(SPEC).role_dir
    target = tmpfs("1m") / "published"  # room for one merged folder, not two
    code, _, err = merge(capsys, role_dir, target)
    assert code == 0, err
    before = tree_digest(target)

    code, _, err = merge(capsys, role_dir, target, "--overwrite")

    assert code == 1
    assert error_lines(err) == [f"error: {staging_path(target) / 'model.safetensors'}: No space left on device"]
    assert "Traceback" not in err
    assert tree_digest(target) == before, "the existing good target must survive"
    assert leftovers(target) == [], "no half-written staging, no lock"


def test_unwritable_target_parent_is_one_line(capsys, fsdp_checkpoint, tmpfs):
    read_only = tmpfs("1m", "ro")
    code, _, err = merge(capsys, fsdp_checkpoint(SPEC).role_dir, read_only / "out")
    assert code == 1
    assert error_lines(err) == [f"error: {read_only}: is not writable: cannot create the target under it"]


def test_merge_killed_while_replacing_is_restored_and_said(capsys, caplog, tmp_path, fsdp_checkpoint):
    role_dir = fsdp_checkpoint(SPEC).role_dir
    target = tmp_path / "published"
    code, _, err = merge(capsys, role_dir, target)
    assert code == 0, err
    before = tree_digest(target)
    # What a kill between the two renames of a replace leaves: the new folder complete, the old one aside.
    shutil.copytree(target, staging_path(target))
    target.rename(previous_path(target))

    with caplog.at_level(logging.WARNING, logger="merge_pipeline"):
        code, _, err = merge(capsys, role_dir, target)

    assert f"{target}: restored from {previous_path(target)}: a merge was killed while replacing it" in caplog.text
    assert code == 1 and "already exists" in error_lines(err)[0], (
        "restored, so a merge without --overwrite leaves it alone"
    )
    assert tree_digest(target) == before
    code, _, err = merge(capsys, role_dir, target, "--overwrite", "--dtype", "bfloat16")
    assert code == 0, err
    assert leftovers(target) == []
