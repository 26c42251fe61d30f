"""The side of a worker whose lead is another process (a Dagster step's torchrun ranks, a Ray task)."""

from __future__ import annotations

from merge_pipeline.pipeline.prepare import prepare
from merge_pipeline.workers.in_process import Workers
from merge_pipeline.workers.writing import WeightJob, Written


def plan_then_write(job: WeightJob, workers: Workers) -> Written:
    """Plan the checkpoint as the lead did (metadata only; the workers agree that each could), then write
    this worker's files (which ones: ``workers.write``'s launcher decides), reusing those the lead kept."""
    with workers.everywhere(lambda: prepare(job.local_dir, job.options)) as prepared:
        return workers.write(job, prepared, show_progress=False)
