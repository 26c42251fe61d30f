"""Sizes are validated before any work: above zero, finite, one line; never a traceback, never accepted as 0."""

from __future__ import annotations

import pytest

from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.helpers import error_lines, run_cli


@pytest.mark.parametrize(
    ("flag", "size", "problem"),
    [
        ("--max-shard-size", "1e999GB", "expected a size such as 64MB or 1GB"),
        ("--max-shard-size", "-1GB", "expected a size such as 64MB or 1GB"),
        ("--max-shard-size", "0GB", "must be at least 1 byte"),
        ("--max-side-file-size", "0", "must be at least 1 byte"),
        ("--max-side-file-size", "9" * 400 + "TB", "expected a size such as 64MB or 1GB"),
    ],
    ids=["overflowing", "negative", "zero", "zero_side_file", "huge_side_file"],
)
def test_a_bad_size_is_one_line_before_any_work(capsys, tmp_path, fsdp_checkpoint, flag, size, problem):
    target = tmp_path / "new_parent" / "out"
    code, out, err = run_cli(
        capsys, "merge", "--local_dir", fsdp_checkpoint(FsdpSpec(world_size=3, with_optimizer=False)).role_dir,
        "--target_dir", target, "--no-progress", f"{flag}={size}",
    )  # fmt: skip

    assert code == 1 and "Traceback" not in err
    assert error_lines(err) == [f"error: {flag} {size!r}: {problem}"]
    assert not target.parent.exists(), "refused before anything was created"
