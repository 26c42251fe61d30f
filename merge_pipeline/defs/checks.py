"""Asset checks on ``hf_model``, run in the same run as the asset (blocking: a failed check stops what depends on it)."""

import warnings
from collections.abc import Callable
from pathlib import Path

import dagster as dg

from merge_pipeline.defs.assets import hf_model
from merge_pipeline.defs.folder_checks import index_problems, manifest_problems, meta_load_problems
from merge_pipeline.defs.partitions import CheckpointKey, checkpoint_partitions
from merge_pipeline.defs.resources import MergeSettings


def _result(problems: list[str], passed_text: str) -> dg.AssetCheckResult:
    metadata = {"problems": dg.MetadataValue.md("\n".join(f"- {p}" for p in problems[:50]) or passed_text)}
    return dg.AssetCheckResult(passed=not problems, metadata=metadata)


def _published(context: dg.AssetCheckExecutionContext, settings: MergeSettings) -> Path:
    return settings.target_dir(CheckpointKey.parse(context.partition_key))


def _folder_check(name: str, find_problems: Callable[[Path], list[str]], passed_text: str, description: str) -> dg.AssetChecksDefinition:
    def check(context: dg.AssetCheckExecutionContext, settings: MergeSettings) -> dg.AssetCheckResult:
        try:
            problems = find_problems(_published(context, settings))
        except (OSError, ValueError, KeyError) as exc:  # unreadable file, bad JSON: the check fails, with one line
            problems = [f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"]
        return _result(problems, passed_text)

    # Partitioned checks (a result per checkpoint, not one for the asset) are a preview in Dagster 1.13:
    # they work when run with their asset, as the merge job does; a checks-only run of a partition fails.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dg.PreviewWarning)
        return dg.asset_check(asset=hf_model, name=name, blocking=True, partitions_def=checkpoint_partitions, description=description)(check)


loads_on_meta_device = _folder_check(
    "loads_on_meta_device",
    meta_load_problems,
    "every weight loads into the config's architecture with the stored shape and dtype",
    "transformers builds the architecture config.json names on the meta device from this folder: no missing, unexpected or reshaped keys, dtypes as stored",
)
index_matches_shards = _folder_check(
    "index_matches_shards",
    index_problems,
    "the index maps every stored tensor to the file holding it, total_size matches",
    "model.safetensors.index.json maps exactly the tensors each shard holds, and its total_size is their byte count",
)
manifest_sha256 = _folder_check(
    "manifest_sha256",
    manifest_problems,
    "every file matches the manifest's size and sha256",
    "every file of the folder has the size and sha256 merge_manifest.json records, and no file is unlisted",
)

defs = dg.Definitions(asset_checks=[loads_on_meta_device, index_matches_shards, manifest_sha256])
