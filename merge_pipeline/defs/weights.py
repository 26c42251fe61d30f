"""The weight-writing step of ``merged_state_dict``, behind one function signature so it can be swapped.

A writer takes a ``WeightJob`` and streams the safetensors shards and their index into the staging
folder; ``write_in_process`` does it in the run's own process. A launcher that runs the same job
under torchrun (through dagster-pipes) is another function ``(WeightJob) -> WrittenWeights``, picked
by a ``launcher`` field of ``MergeConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from merge_pipeline.engine.merge import WriteReport, peak_rss_bytes, prepare, write_index, write_weights
from merge_pipeline.engine.outputs import MergeOptions


@dataclass(frozen=True)
class WeightJob:
    role_dir: Path
    backend: str
    staging: Path  # empty, beside the target: the shards are renamed into place with the rest
    options: MergeOptions


@dataclass(frozen=True)
class WrittenWeights:
    report: WriteReport
    peak_rss_bytes: int  # of the process(es) that did the writing


def write_in_process(job: WeightJob) -> WrittenWeights:
    plan, _, layout = prepare(job.role_dir, job.options, job.backend)
    with plan:
        report = write_weights(layout, job.staging)
        write_index(layout, job.staging)
    return WrittenWeights(report, peak_rss_bytes())
