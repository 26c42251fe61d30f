"""The job the sensor launches: the whole merge chain and its checks for one checkpoint partition."""

from __future__ import annotations

import dagster as dg

from merge_pipeline.defs.assets import checkpoint, hf_model, merged_state_dict, parallel_config

HEAVY_TAG = "merge_pipeline/heavy"  # dagster.yaml lets one run with this tag run at a time

merge_checkpoint_job = dg.define_asset_job(
    "merge_checkpoint",
    selection=dg.AssetSelection.assets(checkpoint, parallel_config, merged_state_dict, hf_model),  # with their checks
    tags={HEAVY_TAG: "merge"},
    # One process for the whole chain: each step would otherwise pay seconds of imports
    # (torch, transformers) on its own; the merge streams, so memory stays bounded anyway.
    executor_def=dg.in_process_executor,
    description="Merge one checkpoint role folder into a verified, published Hugging Face folder.",
)

defs = dg.Definitions(jobs=[merge_checkpoint_job])
