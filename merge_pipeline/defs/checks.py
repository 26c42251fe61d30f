"""The three blocking checks of ``hf_model``, run by the asset itself against the staging folder, before publishing.

They are part of the ``hf_model`` step (``check_specs``), so they run exactly when a folder is
merged, for that partition, and the UI does not offer them on their own: a checks-only run would
have no staged folder to look at.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import dagster as dg

from merge_pipeline.defs.partitions import checkpoint_partitions
from merge_pipeline.errors import MergeError
from merge_pipeline.hf.folder_checks import index_problems, manifest_problems, meta_load_problems, weight_files
from merge_pipeline.hf.manifest import read_manifest

HF_MODEL = dg.AssetKey("hf_model")
# Each check sits on the stage it checks: the index against the shards on the weights (state_dict),
# the others look at the whole folder (hf_model).
CHECKED_ASSET = {"index_matches_shards": dg.AssetKey("state_dict")}


@dataclass(frozen=True)
class FolderCheck:
    name: str
    find_problems: Callable[[Path], list[str]]
    passed_text: str
    description: str


FOLDER_CHECKS = [
    FolderCheck(
        "loads_on_meta_device",
        meta_load_problems,
        "every weight loads into the config's architecture with the stored shape and dtype",
        "transformers builds the architecture config.json names on the meta device from this folder: no missing, unexpected or reshaped keys, dtypes as stored",
    ),
    FolderCheck(
        "index_matches_shards",
        index_problems,
        "the index maps every stored tensor to the file holding it, total_size matches",
        "model.safetensors.index.json maps exactly the tensors each shard holds, and its total_size is their byte count",
    ),
    FolderCheck(
        "manifest_sha256",
        manifest_problems,
        "every file matches the manifest's size and sha256",
        "every file of the folder has the size and sha256 merge_manifest.json records, and no file is unlisted",
    ),
]
with (
    warnings.catch_warnings()
):  # partitioned checks (a result per checkpoint, not one for the asset) are a preview in Dagster 1.13
    warnings.simplefilter("ignore", dg.PreviewWarning)
    CHECK_SPECS = [
        dg.AssetCheckSpec(
            c.name,
            asset=CHECKED_ASSET.get(c.name, HF_MODEL),
            blocking=True,
            description=c.description,
            partitions_def=checkpoint_partitions,
        )
        for c in FOLDER_CHECKS
    ]


def check_staged_folder(folder: Path) -> list[dg.AssetCheckResult]:
    """Every check's result for a complete (not yet published) folder, with what it counted."""
    counts = _counts(folder)
    return [_run(check, folder, counts) for check in FOLDER_CHECKS]


def _run(check: FolderCheck, folder: Path, counts: dict[str, int]) -> dg.AssetCheckResult:
    try:
        problems = check.find_problems(folder)
    except Exception as exc:  # noqa: BLE001 - a file that breaks the reader (bad JSON, a config transformers rejects) fails the check, in one line
        problems = [f"{type(exc).__name__}: {' '.join(str(exc).split())}"]
    metadata = {
        "problems": dg.MetadataValue.md("\n".join(f"- {p}" for p in problems[:50]) or check.passed_text),
        "problem count": len(problems),
        **counts,
    }
    return dg.AssetCheckResult(
        asset_key=CHECKED_ASSET.get(check.name, HF_MODEL), check_name=check.name, passed=not problems, metadata=metadata
    )


def _counts(folder: Path) -> dict[str, int]:
    """What the checks looked at, so a passed check says how much it verified."""
    try:
        shards = weight_files(folder)
        files = read_manifest(folder)["files"]
    except (OSError, ValueError, KeyError, MergeError):
        return {}  # the checks themselves say what is wrong
    return {
        "weight files": len(shards),
        "tensors": sum(len(t) for t in shards.values()),
        "files in manifest": len(files),
        "bytes in manifest": sum(f["size"] for f in files.values()),
    }
