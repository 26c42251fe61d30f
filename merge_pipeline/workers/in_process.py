"""The ``Workers`` interface of the merge sequence, and its first launcher: this one process writes everything."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from merge_pipeline.workers.writing import Prepared, WeightJob, Written, peak_rss_bytes, write_share

T = TypeVar("T")


class Workers:
    """Who writes which weight files and how workers agree, injected into ``merge``.

    This base is one process doing everything: agreeing is running the step. Launchers subclass it
    (``torchrun.TorchrunRanks``: every rank runs ``merge``; ``ray_tasks.RayTasks``: Ray tasks write;
    ``dagster.weights.TorchrunLaunch``: the Dagster step leads and torchrun ranks write), overriding what
    differs and nothing else."""

    lead = True  # the one worker that holds the target's lock, writes the side files and publishes

    def everywhere(self, step: Callable[[], T]) -> T:
        """Run ``step`` on every worker; all fail together with the first failure."""
        return step()

    def on_lead(self, step: Callable[[], T]) -> T | None:
        """Run ``step`` on the lead only; every worker learns whether it failed. ``None`` elsewhere."""
        return step()

    def share(self, value: T | None) -> T:
        """The lead's ``value``, on every worker (picklable)."""
        return value

    def write(self, job: WeightJob, prepared: Prepared, *, show_progress: bool) -> Written:
        """The weight files into ``job.staging``, reusing the files a killed merge finished there."""
        report = write_share(job, prepared, prepared.outputs.files, show_progress=show_progress)
        return Written(report, peak_rss_bytes(), "peak RSS (whole process)")


IN_PROCESS = Workers()
