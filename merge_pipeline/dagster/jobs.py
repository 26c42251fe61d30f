"""The jobs the sensors launch: one checkpoint partition merged, checked and published; then its step report."""

from __future__ import annotations

import dagster as dg

from merge_pipeline.dagster.keys import HEAVY_TAG
from merge_pipeline.dagster.names import Names


def merge_checkpoint_job(names: Names, merge_config: dict | None = None) -> dg.UnresolvedAssetJobDefinition:
    """``merge_config``: the merge step's default config (``MergeConfig`` fields) for the runs it starts:
    the sensor's carry none of their own, the Launchpad shows it filled in."""
    return dg.define_asset_job(
        names("merge_checkpoint"),
        # the merge step and its blocking checks (step_report's run in its own job)
        selection=dg.AssetSelection.assets(*map(names.key, ("parallel_config", "state_dict", "hf_model"))),
        tags={HEAVY_TAG: "merge"},
        # One process for the whole step (the code location's default executor, so runs started from
        # the UI, the CLI or a backfill get it too): a step in its own process would pay seconds of
        # imports (torch, transformers); the merge streams, so memory stays bounded anyway.
        executor_def=dg.in_process_executor,
        config={"ops": {names("hf_model"): {"config": merge_config}}} if merge_config else None,
        description="Merge one checkpoint role folder into a verified, published Hugging Face folder.",
    )


def report_job(names: Names) -> dg.UnresolvedAssetJobDefinition:
    return dg.define_asset_job(
        names("report_merged_step"),
        selection=dg.AssetSelection.assets(names.key("step_report")),
        tags={HEAVY_TAG: "report"},  # it reads every weight: not beside a merge
        executor_def=dg.in_process_executor,
        description=f"The step report of a published folder (requested by {names('step_report_sensor')} after each merge).",
    )
