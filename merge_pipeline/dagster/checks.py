"""The three blocking checks as Dagster asset checks of ``hf_model``, one result per partition.

They are part of the merge step: ``pipeline.folder.check_before_publishing`` (the CLI's own function) runs them on
the staging folder before the rename. The step then yields one ``AssetCheckResult`` per check with the
materialization of ``hf_model``; when a check refused the folder, it yields them (the failed one failed, with
its problems) and fails with the CLI's line, publishing nothing. A merge that fails before the checks ran (a
truncated rank file) leaves the run's planned checks without a result: Dagster shows them as "Execution
failed", its way of saying the check did not run on that partition (docs/DAGSTER.md).

``hf_model``'s materialization also lists the checks that passed (``PASSED``): the Hub's schedule and the step
report read it from the event they already read. The averaged model, which has no asset checks, shows them as
metadata (``checks_metadata``).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import dagster as dg

from merge_pipeline.dagster.instance_names import Names
from merge_pipeline.errors import MergeError
from merge_pipeline.hf.blocking_checks import BLOCKING_CHECKS, CHECK_NAMES, CheckOutcome
from merge_pipeline.hf.manifest import read_manifest
from merge_pipeline.progress import human_bytes
from merge_pipeline.store.listing import Folder, in_store
from merge_pipeline.store.published_prefix import complete_target
from merge_pipeline.watch.keys import CHECKED, PASSED

PROBLEMS_SHOWN = 20  # a folder broken everywhere: the first problems say enough, the count says the rest


def blocking_check_specs(names: Names) -> list[dg.AssetCheckSpec]:
    """The checks of ``hf_model``: blocking, partitioned as it is (a preview in Dagster 1.13: run with the asset)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dg.PreviewWarning)
        return [
            dg.AssetCheckSpec(
                check.name,
                asset=names.key("hf_model"),
                blocking=True,
                partitions_def=names.partitions,
                description=check.description,
            )
            for check in BLOCKING_CHECKS
        ]


def check_results(outcomes: list[CheckOutcome], folder: Folder, names: Names) -> list[dg.AssetCheckResult]:
    """One result per check: what a passed one verified and how much it looked at, a failed one's problems."""
    looked_at = _looked_at(folder) if all(o.passed for o in outcomes) else None  # a refused folder is gone
    return [
        dg.AssetCheckResult(
            asset_key=names.key("hf_model"),
            check_name=o.check.name,
            passed=o.passed,
            description=o.check.passed_text if o.passed else o.problems[0],
            metadata={"looked at": looked_at}
            if o.passed
            else {
                "problems": len(o.problems),
                "first problems": dg.MetadataValue.md("\n".join(f"- {p}" for p in o.problems[:PROBLEMS_SHOWN])),
            },
        )
        for o in outcomes
    ]


def passed_metadata(outcomes: list[CheckOutcome]) -> dict[str, dg.MetadataValue]:
    """The checks the published folder passed, as its materialization lists them (``passed_every_check``)."""
    return {PASSED: dg.MetadataValue.json([o.check.name for o in outcomes if o.passed])}


def checked_stage(check_name: str) -> str:
    """Each check shows on the stage it looks at: the index against the shards on the weights
    (state_dict), the others look at the whole folder (hf_model)."""
    return "state_dict" if check_name == "index_matches_shards" else "hf_model"


def checks_metadata(outcomes: list[CheckOutcome], folder: Folder) -> dict[str, dict]:
    """The averaged model's metadata (it has no asset checks), per stage (``state_dict``, ``hf_model``): which
    checks passed on the published folder, what each verified and how much it looked at."""
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
    metadata["hf_model"].update(passed_metadata(outcomes))
    return metadata


def passed_every_check(metadata: Mapping[str, dg.MetadataValue]) -> bool:
    """A materialization of hf_model by a merge whose blocking checks all passed (not one recorded as
    found by the sensor, which no check looked at)."""
    return PASSED in metadata and set(metadata[PASSED].value) >= set(CHECK_NAMES)


def _looked_at(folder: Folder) -> str:
    """What the checks looked at, so a passed check says how much it verified."""
    from merge_pipeline.hf.folder_checks import weight_files  # torch: imported by a run, not by the location's load

    try:
        if store := in_store(folder):  # counted from its manifest: no weight file downloaded to count it
            manifest = complete_target(store)
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
