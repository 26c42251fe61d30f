"""Merged steps to average, published as ``hf_model`` publishes them, without a Dagster merge run each."""

from __future__ import annotations

import dataclasses
import shutil

from merge_pipeline.options import MergeOptions
from merge_pipeline.pipeline.merge import merge
from merge_pipeline_samples.fsdp import FsdpSpec

STEP = FsdpSpec(with_optimizer=False)  # the averaging tests' steps (seeds 0, 1, 2): written once per session


def publish_merged_steps(fsdp_checkpoint, roots, instance, runs: tuple[str, ...], partitions="checkpoints") -> None:
    """Three merged steps (actor) in each of ``runs`` under the output root, their checkpoint partitions
    known to the instance (``partitions``: the component's name for them). Merged once, copied to the others."""
    for step in (1, 2, 3):
        sample = fsdp_checkpoint(dataclasses.replace(STEP, seed=step - 1))
        keys = [f"{run}/global_step_{step}/actor" for run in runs]
        merge(sample.role_dir, roots.target(keys[0]), MergeOptions(), show_progress=False)
        for key in keys[1:]:
            shutil.copytree(roots.target(keys[0]), roots.target(key))
        instance.add_dynamic_partitions(partitions, keys)
