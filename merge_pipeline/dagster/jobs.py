"""The jobs the sensors launch: one checkpoint partition merged, checked and published; then its step report."""

from __future__ import annotations

import dagster as dg

from merge_pipeline.dagster.instance_names import Names
from merge_pipeline.watch.keys import HEAVY_TAG


def merge_checkpoint_job(names: Names) -> dg.UnresolvedAssetJobDefinition:
    """Its runs carry no config of their own: hf_model's defaults are the component's ``merge_config``."""
    return dg.define_asset_job(
        names("merge_checkpoint"),
        # the merge step and its blocking checks (step_report's run in its own job)
        selection=dg.AssetSelection.assets(*map(names.key, ("parallel_config", "state_dict", "hf_model"))),
        tags={HEAVY_TAG: "merge"},
        # One process for the whole step (the code location's default executor, so runs started from
        # the UI, the CLI or a backfill get it too): a step in its own process would pay seconds of
        # imports (torch, transformers); the merge streams, so memory stays bounded anyway.
        executor_def=dg.in_process_executor,
        description="Merge one checkpoint into a published HF folder.\n\nOne role folder into a verified, published Hugging Face folder.",
    )


def report_job(names: Names) -> dg.UnresolvedAssetJobDefinition:
    return dg.define_asset_job(
        names("report_merged_step"),
        selection=dg.AssetSelection.assets(names.key("step_report")),
        tags={HEAVY_TAG: "report"},  # it reads every weight: not beside a merge
        executor_def=dg.in_process_executor,
        description=f"The step report of a published folder.\n\nRequested by {names('step_report_automation')} after each merge.",
    )
