"""The three blocking checks in the UI: metadata of the stages they looked at, not Dagster asset checks.

They are part of the merge step: ``pipeline.check_before_publishing`` (the CLI's own function) runs
them on the staging folder before the rename, and a failed one fails the step with the CLI's line.
They are not asset checks because Dagster 1.13 plans every check of a run when it creates the run and
shows a planned check of a failed run as "Execution failed" (``AssetCheckExecutionRecord.resolve_status``):
a merge that failed on a truncated rank file would paint checks that never looked at a folder.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import dagster as dg

from merge_pipeline.dagster.keys import CHECKED, PASSED
from merge_pipeline.errors import MergeError
from merge_pipeline.hf.blocking_checks import CHECK_NAMES, CheckOutcome
from merge_pipeline.hf.manifest import read_manifest
from merge_pipeline.progress import human_bytes
from merge_pipeline.storage import complete_target
from merge_pipeline.store_listing import StoreURL


def checked_stage(check_name: str) -> str:
    """Each check shows on the stage it looks at: the index against the shards on the weights
    (state_dict), the others look at the whole folder (hf_model)."""
    return "state_dict" if check_name == "index_matches_shards" else "hf_model"


def checks_metadata(outcomes: list[CheckOutcome], folder: Path | StoreURL) -> dict[str, dict]:
    """Per stage (``state_dict``, ``hf_model``), the metadata saying which checks passed on the published
    folder, what each verified and how much it looked at."""
    looked_at = _looked_at(folder)
    by_stage: dict[str, list[CheckOutcome]] = {}
    for outcome in outcomes:
        by_stage.setdefault(checked_stage(outcome.check.name), []).append(outcome)
    metadata = {
        stage: {
            CHECKED: dg.MetadataValue.md(
                "\n".join(
                    [
                        "| check | passed: verified |",
                        "|---|---|",
                        *(f"| `{o.check.name}` | {o.check.passed_text} |" for o in checked),
                        "",
                        f"Looked at: {looked_at}.",
                    ]
                )
            )
        }
        for stage, checked in by_stage.items()
    }
    metadata["hf_model"][PASSED] = dg.MetadataValue.json([o.check.name for o in outcomes if o.passed])
    return metadata


def passed_every_check(metadata: Mapping[str, dg.MetadataValue]) -> bool:
    """A materialization of hf_model by a merge whose blocking checks all passed (not one recorded as
    found by the sensor, which no check looked at)."""
    return PASSED in metadata and set(metadata[PASSED].value) >= set(CHECK_NAMES)


def _looked_at(folder: Path | StoreURL) -> str:
    """What the checks looked at, so a passed check says how much it verified."""
    from merge_pipeline.hf.folder_checks import weight_files  # torch: imported by a run, not by the location's load

    try:
        if isinstance(folder, StoreURL):  # counted from its manifest: no weight file downloaded to count it
            manifest = complete_target(folder)
            files = manifest["files"]
            shards = [n for n in files if n.startswith("model") and n.endswith(".safetensors")]
            tensors = manifest["tensors"]
        else:
            found = weight_files(folder)
            shards, files = list(found), read_manifest(folder)["files"]
            tensors = sum(len(t) for t in found.values())
    # the checks passed: a folder that cannot be counted (no manifest: None) is not expected, and not worth a failure
    except (OSError, ValueError, KeyError, TypeError, MergeError):
        return "(the folder could not be counted)"
    size = sum(f["size"] for f in files.values())
    return (
        f"{len(shards)} weight file(s), {tensors} tensors; "
        f"{len(files)} files in the manifest, {human_bytes(size)} ({size} bytes)"
    )
