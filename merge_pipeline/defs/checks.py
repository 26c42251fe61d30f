"""The three blocking checks of ``hf_model``, run by the asset itself against the staging folder, before publishing.

The checks themselves, and the function running them, are the CLI's too (``hf/blocking_checks.py``).
They are part of the ``hf_model`` step (``check_specs``), so they run exactly when a folder is
merged, for that partition, and the UI does not offer them on their own: a checks-only run would
have no staged folder to look at.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import dagster as dg

from merge_pipeline.defs.names import PLAIN, Names
from merge_pipeline.errors import MergeError
from merge_pipeline.hf.blocking_checks import BLOCKING_CHECKS, CheckOutcome, Written, run_blocking_checks
from merge_pipeline.hf.manifest import read_manifest


def checked_asset(check_name: str, names: Names) -> dg.AssetKey:
    """Each check sits on the stage it checks: the index against the shards on the weights (state_dict),
    the others look at the whole folder (hf_model)."""
    return names.key("state_dict" if check_name == "index_matches_shards" else "hf_model")


def check_specs(names: Names) -> list[dg.AssetCheckSpec]:
    with (
        warnings.catch_warnings()
    ):  # partitioned checks (a result per checkpoint, not one for the asset) are a preview in Dagster 1.13
        warnings.simplefilter("ignore", dg.PreviewWarning)
        return [
            dg.AssetCheckSpec(
                c.name,
                asset=checked_asset(c.name, names),
                blocking=True,
                description=c.description,
                partitions_def=names.partitions,
            )
            for c in BLOCKING_CHECKS
        ]


CHECK_SPECS = check_specs(PLAIN)


def check_staged_folder(folder: Path, names: Names, written: Written) -> list[dg.AssetCheckResult]:
    """Every check's result for a complete (not yet published) folder, with what it counted: the same
    checks, run by the same function, as the CLI's before it publishes. ``written``: the write report's
    entries by file (the digests computed while writing: see ``hf/blocking_checks.py``)."""
    counts = _counts(folder)
    return [_result(outcome, counts, names) for outcome in run_blocking_checks(folder, written)]


def _result(outcome: CheckOutcome, counts: dict[str, int], names: Names) -> dg.AssetCheckResult:
    metadata = {
        # a passed check says what it verified; only a failed one has a "problems" list
        **(
            {"problems": dg.MetadataValue.md("\n".join(f"- {p}" for p in outcome.problems[:50]))}
            if outcome.problems
            else {"verified": outcome.check.passed_text}
        ),
        "problem count": len(outcome.problems),
        **counts,
    }
    return dg.AssetCheckResult(
        asset_key=checked_asset(outcome.check.name, names),
        check_name=outcome.check.name,
        passed=outcome.passed,
        metadata=metadata,
    )


def _counts(folder: Path) -> dict[str, int]:
    """What the checks looked at, so a passed check says how much it verified."""
    from merge_pipeline.hf.folder_checks import weight_files  # torch: imported by a run, not by the location's load

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
