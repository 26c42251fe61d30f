"""The merge sequence, written once: the CLI, torchrun ranks, the Dagster step and its launchers all run
``merge`` and differ only in the ``Workers`` they pass (``workers``: who writes which weight files, how
workers agree); so every one of them resumes a killed merge.

check the target, prepare (``prepare``), lock and stage (``engine.publish.staged_output``: the one staging
folder + target lock, renamed into place on success), side files, weights, folder and checks (``folder``), publish.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from merge_pipeline.engine.publish import staged_output, staging_path
from merge_pipeline.engine.resume import forget as forget_finished
from merge_pipeline.engine.target import MergeTarget
from merge_pipeline.errors import printable, shown_path
from merge_pipeline.options import MergeOptions
from merge_pipeline.pipeline.folder import check_before_publishing, finish_folder, resume_killed, write_side_files
from merge_pipeline.pipeline.prepare import prepare
from merge_pipeline.progress import human_bytes
from merge_pipeline.store.incomplete_uploads import abort_incomplete_uploads
from merge_pipeline.store.lock import StoreTargetLock, locked_store_target
from merge_pipeline.store.published_prefix import invalidate_target, publish_folder
from merge_pipeline.store.url import as_location
from merge_pipeline.workers.in_process import IN_PROCESS, Workers
from merge_pipeline.workers.writing import Prepared, WeightJob, Written

if TYPE_CHECKING:
    from merge_pipeline.hf.blocking_checks import CheckOutcome


log = logging.getLogger("merge_pipeline")


@dataclass
class MergeResult:
    target_dir: Path | str  # a path, or the store URL published to
    prepared: Prepared  # closed: the plan's metadata and decisions, no open file
    written: Written
    manifest: dict
    checks: list[CheckOutcome]  # the blocking checks, all passed on the published folder
    seconds: float

    @property
    def parameters(self) -> int:
        return self.prepared.plan.parameter_count

    @property
    def tensors(self) -> int:
        return self.written.report.tensors

    @property
    def tensor_bytes(self) -> int:  # bytes of tensor data written (file sizes add the headers)
        return self.prepared.outputs.total_bytes


def merge(
    local_dir: str | Path,
    target_dir: str | Path,
    options: MergeOptions | None = None,
    *,
    workers: Workers = IN_PROCESS,
    show_progress: bool = True,
) -> MergeResult | None:
    """The merge sequence: check the target, plan, lock and stage (resuming a killed merge), side files,
    weights, folder, blocking checks, publish. The lead returns the result, other workers ``None``.

    Every worker runs the same steps in the same order (the collectives of a distributed ``workers``)."""
    started = time.monotonic()
    options = options or MergeOptions()
    # A store target is uploaded from its local twin with the manifest last (``store.published_prefix.publish_folder``).
    target = MergeTarget.of(target_dir, overwrite=options.overwrite)
    local_dir = as_location(local_dir)  # a store URL kept as written
    inputs = (local_dir, *options.average_inputs, *([options.hf_model_path] if options.hf_model_path else []))

    def checked_and_prepared() -> Prepared:
        target.check(inputs)
        return prepare(local_dir, options)

    prepared = workers.everywhere(checked_and_prepared)
    merged_from = _merged_from(prepared, options)  # while a store's view is open: its URL
    job = WeightJob(local_dir, staging_path(target.folder), options, upload_to=target.store)
    store_lock: list[StoreTargetLock | None] = []  # the lead's, once taken
    with prepared, contextlib.ExitStack() as store_locked, contextlib.ExitStack() as publishing:

        def open_staging() -> tuple[dict[str, dict], str | None]:
            if target.store:  # held until the upload ends: the local twin's lock keeps out this machine only
                store_lock.append(store_locked.enter_context(locked_store_target(target.store)))
                abort_incomplete_uploads(target.store)  # a killed merge's: no live merge holds the lock
            token = store_lock[0].guard.token if store_lock and store_lock[0] else None
            publishing.enter_context(
                staged_output(target.folder, source=local_dir, overwrite=target.folder_replaced, keep_killed=True)
            )
            kept = resume_killed(prepared, job.staging, options).finished
            if target.store:  # before the first upload
                names = {f.filename for f in prepared.outputs.files}
                invalidate_target(target.store, names, replace(job, lock_token=token).guard())
            write_side_files(prepared, job.staging, options)
            return kept, token

        kept, token = workers.share(workers.on_lead(open_staging))
        job = replace(job, kept=kept, lock_token=token)
        written = workers.write(job, prepared, show_progress=show_progress)

        def finish_and_publish() -> tuple[dict, list[CheckOutcome]]:
            forget_finished(job.staging)
            manifest = finish_folder(prepared, job.staging, options, written.report)
            checks = check_before_publishing(job.staging, target.folder, written.report)
            publishing.close()  # leaves staged_output cleanly: the rename into place happens here
            if target.store:
                publish_folder(target.folder, target.store, manifest, guard=job.guard())
                shutil.rmtree(target.folder)  # the twin: uploaded, no longer needed
            return manifest, checks

        finished = workers.on_lead(finish_and_publish)
    if not workers.lead:
        return None
    manifest, checks = finished
    result = MergeResult(target.named, prepared, written, manifest, checks, time.monotonic() - started)
    log.info(
        "%s -> %s: %d tensors, %s of safetensors files in %.1f s",
        merged_from,
        result.target_dir,
        result.tensors,
        human_bytes(written.report.bytes),
        result.seconds,
    )
    return result


def _merged_from(prepared: Prepared, options: MergeOptions) -> str:
    """What the log says was merged, as the user named it: a store's URL, every input of an average."""
    if options.average_inputs:
        return f"averaged {', '.join(map(printable, options.average_inputs))}"
    return f"merged {printable(shown_path(prepared.plan.role_dir))}"
