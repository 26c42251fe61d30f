"""Merging under ``torchrun``: every rank writes whole output shards, rank 0 finishes and publishes.

The shard split is decided by the same plan on every rank, so the result is byte-identical to a
single-process merge. Ranks share a filesystem (one staging folder beside the target). A failure
on any rank fails every rank with that rank's one-line error, and nothing is published.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from merge_pipeline.errors import MergeError, os_error
from merge_pipeline.options import MergeOptions
from merge_pipeline.pipeline import (
    MergeResult,
    OutputPlan,
    Prepared,
    ResumeLog,
    ShardFile,
    WriteReport,
    check_before_publishing,
    finish_folder,
    forget_finished,
    peak_rss_bytes,
    prepare,
    resume_finished,
    resume_killed,
    staged_output,
    staging_path,
    write_side_files,
    write_weights,
)

log = logging.getLogger("merge_pipeline")

# How long a rank waits at a collective for the others before failing. It must cover the longest
# phase one rank runs alone: rank 0 hashing the whole output for the manifest (minutes for a
# 400B model on slow storage). A stopped, hung or dead rank fails the others within this time.
DIST_TIMEOUT_ENV = "MERGE_PIPELINE_DIST_TIMEOUT"
DEFAULT_DIST_TIMEOUT_SECONDS = 30 * 60
_LEFT_KEY = "merge_pipeline/left_the_last_barrier"
_DONE_KEY = "merge_pipeline/done_with_the_store"


def launched_by_torchrun() -> bool:
    """True only in a rank that torchrun started (it sets TORCHELASTIC_RUN_ID), with other ranks.

    WORLD_SIZE / RANK / MASTER_* left over in a plain shell must not make one process wait for
    ranks that will never come: without torchrun's own variables the merge runs in one process.
    """
    return "TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("WORLD_SIZE", "1") != "1"


def dist_timeout(seconds: float | None = None) -> float:
    """``seconds`` if given, else $MERGE_PIPELINE_DIST_TIMEOUT, else the default; always positive."""
    if seconds is None:
        text = os.environ.get(DIST_TIMEOUT_ENV, str(DEFAULT_DIST_TIMEOUT_SECONDS))
        try:
            seconds = float(text)
        except ValueError:
            raise MergeError(None, f"{DIST_TIMEOUT_ENV}={text!r}: expected a number of seconds") from None
    if not seconds > 0:
        raise MergeError(None, f"--dist-timeout {seconds:g}: must be a positive number of seconds")
    return seconds


@contextlib.contextmanager
def _peers_answer() -> Iterator[None]:
    """Around a collective: gloo's or the rendezvous store's failure to reach a peer, as one line."""
    try:
        yield
    except RuntimeError:  # DistStoreError, gloo timeouts and closed connections are all RuntimeErrors
        raise MergeError(
            None,
            f"rank {os.environ.get('RANK', '?')}: another rank stopped answering (stopped, hung or dead) within the --dist-timeout ({DIST_TIMEOUT_ENV}); nothing was published",
        ) from None


def assign_shards(files: list[ShardFile], world_size: int) -> list[list[ShardFile]]:
    """Balance bytes: biggest file first to the least-loaded rank (deterministic on every rank)."""
    loads = [0] * world_size
    assigned: list[list[ShardFile]] = [[] for _ in range(world_size)]
    for f in sorted(files, key=lambda f: (-f.nbytes, f.filename)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        assigned[rank].append(f)
        loads[rank] += f.nbytes
    return assigned


def _agree(error: str | None) -> None:
    """Collective: every rank learns whether any rank failed; all raise the first failure."""
    errors: list[str | None] = [None] * dist.get_world_size()
    with _peers_answer():
        dist.all_gather_object(errors, error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if failed:
        rank, message = failed[0]
        raise MergeError(None, message if rank == dist.get_rank() else f"rank {rank} failed: {message}")


def _attempt(step) -> str | None:
    try:
        step()
    except MergeError as exc:
        return str(exc)
    except OSError as exc:
        return str(os_error(exc))
    return None


@contextlib.contextmanager
def _process_group(timeout_seconds: float | None):
    with _peers_answer():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=dist_timeout(timeout_seconds)))
    try:
        yield dist.get_rank(), dist.get_world_size()
        with _peers_answer():
            # Every rank's last messages are delivered before any rank tears down its connections:
            # without it a rank that finished first could abort a peer still reading ("terminate called").
            dist.barrier()
            _all_left_the_barrier(dist_timeout(timeout_seconds))
    finally:
        dist.destroy_process_group()


def _all_left_the_barrier(timeout_seconds: float) -> None:
    """Wait, through the rendezvous store, until every rank has returned from the last barrier.

    gloo's barrier returns on a rank before its own last messages to peers are flushed; a rank that
    destroys its connections then can abort a peer still finishing it ("terminate called without an
    active exception", pytorch/gloo#155), failing a merge that was published. The store answers
    requests one by one, so once the count is full no rank is inside gloo any more. Rank 0 leaves
    last: where it hosts the store (not under torchrun, whose agent does), no peer's request is lost."""
    store = dist.distributed_c10d._get_default_store()  # the process group's own store
    deadline = time.monotonic() + timeout_seconds

    def count_to_world(key: str) -> None:
        while store.add(key, 0) < dist.get_world_size():
            if time.monotonic() > deadline:
                raise RuntimeError(f"a rank did not reach {key}")  # -> _peers_answer's one line
            time.sleep(0.01)

    store.add(_LEFT_KEY, 1)
    count_to_world(_LEFT_KEY)
    store.add(_DONE_KEY, 1)
    if dist.get_rank() == 0:
        count_to_world(_DONE_KEY)


def _prepare_everywhere(local_dir, options: MergeOptions) -> Prepared:
    """Every rank validates and plans (metadata only); all fail together on the first problem."""
    prepared: list[Prepared] = []
    _agree(_attempt(lambda: prepared.append(prepare(local_dir, options))))
    return prepared[0]


def _write_share(
    outputs: OutputPlan, staging: Path, rank: int, world: int, *, show_progress: bool, resume: ResumeLog | None = None
) -> tuple[WriteReport, int]:
    """Write this rank's whole shard files; return the report of all ranks and their largest peak RSS."""
    mine = assign_shards(outputs.files, world)[rank]
    log.info("rank %d/%d writes %d of %d weight files", rank, world, len(mine), len(outputs.files))
    reports: list[WriteReport] = []

    def write() -> None:
        reports.append(write_weights(outputs, staging, files=mine, show_progress=show_progress, resume=resume))

    _agree(_attempt(write))
    everyone: list[tuple[WriteReport, int] | None] = [None] * world
    with _peers_answer():
        dist.all_gather_object(everyone, (reports[0], peak_rss_bytes()))
    # Files in plan order, the time of the slowest rank.
    by_name = {f["filename"]: f for report, _ in everyone for f in report.files}
    whole = WriteReport([by_name[f.filename] for f in outputs.files], max(report.seconds for report, _ in everyone))
    return whole, max(peak for _, peak in everyone)


def write_weights_distributed(
    local_dir: str | Path, staging: Path, options: MergeOptions
) -> tuple[WriteReport, int] | None:
    """Only the weight shards into an existing staging folder, as Dagster's merged_state_dict needs.

    Rank 0 returns the whole report and the largest peak RSS of any rank; other ranks ``None``.
    The wait for other ranks is $MERGE_PIPELINE_DIST_TIMEOUT (or the default).
    """
    with _process_group(None) as (rank, world):
        with _prepare_everywhere(local_dir, options) as prepared:
            written = _write_share(prepared.outputs, staging, rank, world, show_progress=False)
            return written if rank == 0 else None


def merge_distributed(
    local_dir: str | Path,
    target_dir: str | Path,
    options: MergeOptions,
    *,
    show_progress: bool = True,
    timeout_seconds: float | None = None,
) -> MergeResult | None:
    """Run one rank's part of the merge; rank 0 returns the result, other ranks ``None``.

    The same sequence of collectives on every rank: prepared, staging ready, written, published.
    A rank waits at most ``timeout_seconds`` (default: see ``dist_timeout``) for the others.
    """
    target = Path(target_dir).absolute()
    started = time.monotonic()
    with _process_group(timeout_seconds) as (rank, world):
        lead = rank == 0
        prepared = _prepare_everywhere(local_dir, options)
        plan, outputs = prepared.plan, prepared.outputs
        staging = staging_path(target)
        with prepared, contextlib.ExitStack() as publishing:

            def open_staging() -> None:
                publishing.enter_context(
                    staged_output(target, source=local_dir, overwrite=options.overwrite, keep_killed=True)
                )
                resume_killed(prepared, staging, options)
                write_side_files(prepared, staging, options)

            _agree(_attempt(open_staging) if lead else None)
            resume = resume_finished(prepared, staging, options)
            written, _ = _write_share(
                outputs, staging, rank, world, show_progress=show_progress and lead, resume=resume
            )
            manifest: list[dict] = []

            def finish_and_publish() -> None:
                forget_finished(staging)
                manifest.append(finish_folder(prepared, staging, options, written))
                check_before_publishing(staging, target, written)
                publishing.close()  # leaves staged_output cleanly: the rename to the target happens here

            _agree(_attempt(finish_and_publish) if lead else None)
        if not lead:
            return None
        tensors = sum(len(f.tensors) for f in outputs.files)
        return MergeResult(
            target,
            plan.parameter_count,
            tensors,
            outputs.total_bytes,
            time.monotonic() - started,
            peak_rss_bytes(),
            manifest[0],
        )
