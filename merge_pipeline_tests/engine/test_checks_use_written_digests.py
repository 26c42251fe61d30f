"""The blocking check ``manifest_sha256`` before publishing compares each weight file by the sha256 the
merge computed while writing it (the write report's), as long as the file is still the one it hashed
(same stat identity), so no weight byte is hashed twice; a file changed since is hashed and refused.
A folder on its own (no write report) is still hashed byte for byte.

The stages are the pipeline's own (written, finished, checked), as the CLI, torchrun rank 0 and the
Dagster asset run them; the change comes between finishing and checking.
"""

from __future__ import annotations

import pytest

from merge_pipeline.engine.publish import staged_output
from merge_pipeline.errors import MergeError
from merge_pipeline.hf.folder_checks import manifest_problems
from merge_pipeline.options import MergeOptions
from merge_pipeline.pipeline.folder import check_before_publishing, finish_folder, write_side_files
from merge_pipeline.pipeline.prepare import prepare
from merge_pipeline.workers.writing import write_weights
from merge_pipeline_samples.fsdp import FsdpSpec

SPEC = FsdpSpec(world_size=2, with_optimizer=False)
OPTIONS = MergeOptions(max_shard_size="100KB")  # several weight files


def flip_last_byte(path) -> None:
    """One byte of tensor data changed in place: same size, header intact, a new ctime."""
    with open(path, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))


def _merge_until_checked(fsdp_checkpoint, target, between) -> None:
    """Prepare, write, finish, then ``between(staging, report)``, then the blocking checks and publishing."""
    role_dir = fsdp_checkpoint(SPEC).role_dir
    with (
        prepare(role_dir, OPTIONS) as prepared,
        staged_output(target, source=role_dir, overwrite=False) as staging,
    ):
        write_side_files(prepared, staging, OPTIONS)
        report = write_weights(prepared.outputs, staging, show_progress=False)
        finish_folder(prepared, staging, OPTIONS, report)
        between(staging, report)
        check_before_publishing(staging, target, report)


def test_a_weight_file_changed_after_it_was_written_is_hashed_and_refused(tmp_path, fsdp_checkpoint):
    target = tmp_path / "out"
    changed = []

    def change_one(staging, report):
        changed.append(report.files[1]["filename"])
        flip_last_byte(staging / changed[0])

    with pytest.raises(MergeError) as refused:
        _merge_until_checked(fsdp_checkpoint, target, change_one)

    assert "blocking check(s) manifest_sha256 failed" in str(refused.value)
    assert f"{changed[0]}: sha256 or size differs from the manifest" in str(refused.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "nothing published, no staging or lock left"


def test_the_check_takes_the_writers_digest_and_a_folder_on_its_own_is_hashed(tmp_path, fsdp_checkpoint):
    """A digest in the report that the file's bytes do not have: taken as it is, so the report, not a
    second read, is what the check compares (refused); the same folder checked on its own is hashed
    file by file and passes."""
    target = tmp_path / "out"
    seen = {}

    def misreport_one(staging, report):
        entry = report.files[0]
        seen.update(problems_alone=manifest_problems(staging), name=entry["filename"])
        entry["sha256"] = "0" * 64

    with pytest.raises(MergeError) as refused:
        _merge_until_checked(fsdp_checkpoint, target, misreport_one)

    assert f"{seen['name']}: sha256 or size differs from the manifest" in str(refused.value)
    assert seen["problems_alone"] == []
