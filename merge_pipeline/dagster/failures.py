"""Engine errors become a failed step in Dagster's words: the engine's one line, with the CLI's flags
named as the run config fields that set them, and the file at fault and the next step as metadata.

The instance's ``run_retries`` retry a run whose worker crashed, never one whose step failed
(``retry_on_asset_or_op_failure: false``: a bad checkpoint fails the same way again), except a step that
failed because its store did not answer after the library's retries: that run is tagged to be retried."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import dagster as dg

from merge_pipeline.errors import MergeError, StoreUnavailable, os_error
from merge_pipeline.options import OPTION_FIELDS, cli_flags

RUN_CONFIG = "hf_model's run config"
RETRY_ON_STEP_FAILURE = "dagster/retry_on_asset_or_op_failure"  # the run's own word over the instance's setting
# CLI flag in an engine message -> where a Dagster user sets the same thing (MergeConfig's fields)
_IN_DAGSTER = {
    **{flag: option.name for option in OPTION_FIELDS for flag in cli_flags(option)},
    "pass --overwrite": f"set overwrite: true in {RUN_CONFIG}",
    "--overwrite": f"overwrite: true in {RUN_CONFIG}",
    "--target_dir": "MERGE_PIPELINE_OUTPUT_ROOT",
}
_FLAG = re.compile("|".join(re.escape(f) for f in sorted(_IN_DAGSTER, key=len, reverse=True)) + r"(?![\w-])")

# What to do next, by what the message says; the first match wins.
_NEXT_STEPS = [
    (
        "already exists",
        f"to replace it, materialize the partition again with overwrite: true in {RUN_CONFIG} (Launchpad)",
    ),
    ("another merge", "wait for that merge to finish, then re-execute this run"),
    ("did not answer after retries", "the store failed: the instance retries this run (run_retries), or re-execute it"),
    ("incomplete checkpoint", "wait until the trainer has finished saving this step, then re-execute this run"),
    ("no such checkpoint folder", "the checkpoint is gone: nothing to merge (the sensor removes its partition)"),
    ("not replaced", "move the folder away or set MERGE_PIPELINE_OUTPUT_ROOT elsewhere, then re-execute"),
    ("not published: blocking check", "fix the checkpoint (or report the problem), then re-execute this run"),
]
_DEFAULT_NEXT_STEP = "fix the file named above (or the run config), then re-execute this run from the Runs page"


def in_dagster_words(message: str) -> str:
    return _FLAG.sub(lambda m: _IN_DAGSTER[m.group(0)], message)


def next_step(message: str) -> str:
    return next((step for words, step in _NEXT_STEPS if words in message), _DEFAULT_NEXT_STEP)


def failure(error: MergeError) -> dg.Failure:
    message = in_dagster_words(str(error))
    metadata = {"next step": next_step(message)}
    if error.path is not None:
        metadata["file"] = dg.MetadataValue.path(str(error.path))
    return dg.Failure(description=message, metadata=metadata)


@contextlib.contextmanager
def one_line_failure() -> Iterator[None]:
    try:
        yield
    except StoreUnavailable as exc:
        context = dg.OpExecutionContext.get()
        context.instance.add_run_tags(context.run_id, {RETRY_ON_STEP_FAILURE: "true"})  # read when the run fails
        raise failure(exc) from None
    except MergeError as exc:
        raise failure(exc) from None
    except OSError as exc:  # disk full, permission denied, ...: name the file, as the CLI does
        raise failure(os_error(exc)) from None
