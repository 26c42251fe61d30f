"""``workers_for``: the one place every entry point gets who writes its weights."""

from __future__ import annotations

import pytest

from merge_pipeline.errors import MergeError
from merge_pipeline.workers import workers_for
from merge_pipeline.workers.in_process import IN_PROCESS, Workers


def test_in_process_is_this_process_and_torchrun_with_a_launch_is_the_launch_given():
    launched = Workers()
    with workers_for("inprocess", launch_torchrun=lambda: launched) as workers:
        assert workers is IN_PROCESS
    with workers_for("torchrun", launch_torchrun=lambda: launched) as workers:
        assert workers is launched


def test_an_unknown_launcher_is_one_line():
    with pytest.raises(MergeError, match=r"^launcher 'slurm': expected one of inprocess, torchrun, ray$"):
        with workers_for("slurm"):
            pass
