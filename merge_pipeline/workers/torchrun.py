"""Workers that are ``torchrun``'s ranks: every rank writes whole output shards, rank 0 leads.

``TorchrunRanks`` is the ``Workers`` of the one merge sequence (``pipeline.merge``) for torchrun ranks:
agreeing is a gloo collective, writing is each rank's share. The shard split is decided by the same
plan on every rank, so the result is byte-identical to a single-process merge. Ranks share a
filesystem (one staging folder beside the target). A failure on any rank fails every rank with that
rank's one-line error, and nothing is published.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch.distributed as dist

from merge_pipeline.errors import MergeError, os_error
from merge_pipeline.settings import DIST_TIMEOUT
from merge_pipeline.workers.in_process import Workers
from merge_pipeline.workers.remote import plan_then_write
from merge_pipeline.workers.writing import (
    Prepared,
    WeightJob,
    WriteReport,
    Written,
    assign_shards,
    gathered,
    peak_rss_bytes,
    write_share,
)

log = logging.getLogger("merge_pipeline")

# How long a rank waits at a collective for the others before failing. It must cover the longest
# phase one rank runs alone: rank 0 hashing the whole output for the manifest (minutes for a
# 400B model on slow storage). A stopped, hung or dead rank fails the others within this time.
_LEFT_KEY = "merge_pipeline/left_the_last_barrier"
_DONE_KEY = "merge_pipeline/done_with_the_store"
T = TypeVar("T")


def launched_by_torchrun() -> bool:
    """True only in a rank that torchrun started (it sets TORCHELASTIC_RUN_ID), with other ranks.

    WORLD_SIZE / RANK / MASTER_* left over in a plain shell must not make one process wait for
    ranks that will never come: without torchrun's own variables the merge runs in one process.
    """
    return "TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("WORLD_SIZE", "1") != "1"


def dist_timeout(seconds: float | None = None) -> float:
    """``seconds`` if given, else $MERGE_PIPELINE_DIST_TIMEOUT, else the default; always positive."""
    return DIST_TIMEOUT.value(seconds, "--dist-timeout")


@contextlib.contextmanager
def _peers_answer() -> Iterator[None]:
    """Around a collective: gloo's or the rendezvous store's failure to reach a peer, as one line."""
    try:
        yield
    except RuntimeError:  # DistStoreError, gloo timeouts and closed connections are all RuntimeErrors
        raise MergeError(
            None,
            f"rank {os.environ.get('RANK', '?')}: another rank stopped answering (stopped, hung or dead) within the --dist-timeout ({DIST_TIMEOUT.variable}); nothing was published",
        ) from None


class RanksFailedTogether(MergeError):
    """Raised on every rank at the same collective, so every rank can still meet the others once more."""


def _agree(error: str | None) -> None:
    """Collective: every rank learns whether any rank failed; all raise the first failure."""
    errors: list[str | None] = [None] * dist.get_world_size()
    with _peers_answer():
        dist.all_gather_object(errors, error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if failed:
        rank, message = failed[0]
        raise RanksFailedTogether(None, message if rank == dist.get_rank() else f"rank {rank} failed: {message}")


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
        _leave_together(timeout_seconds)
    except RanksFailedTogether:
        # torchrun SIGTERMs every rank once one exits non-zero: a rank leaving at once would kill the lead
        # while it removes its staging folder. The failure stays the one to report, whatever this wait meets.
        with contextlib.suppress(MergeError):
            _leave_together(timeout_seconds)
        raise
    finally:
        dist.destroy_process_group()


def _leave_together(timeout_seconds: float | None) -> None:
    with _peers_answer():
        # Every rank's last messages are delivered before any rank tears down its connections:
        # without it a rank that finished first could abort a peer still reading ("terminate called").
        dist.barrier()
        _all_left_the_barrier(dist_timeout(timeout_seconds))


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


class TorchrunRanks(Workers):
    """The workers are this process group's ranks; rank 0 leads."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world, self.lead = rank, world, rank == 0

    def everywhere(self, step: Callable[[], T]) -> T:
        results: list[T] = []
        _agree(_attempt(lambda: results.append(step())))
        return results[0]

    def on_lead(self, step: Callable[[], T]) -> T | None:
        results: list[T | None] = [None]
        _agree(_attempt(lambda: results.__setitem__(0, step())) if self.lead else None)
        return results[0]

    def share(self, value: T | None) -> T:
        shared = [value]
        with _peers_answer():
            dist.broadcast_object_list(shared, src=0)
        return shared[0]

    def write(self, job: WeightJob, prepared: Prepared, *, show_progress: bool) -> Written:
        """This rank's whole shard files; every rank learns the report of all and their largest peak RSS."""
        outputs = prepared.outputs
        mine = assign_shards(outputs.files, self.world)[self.rank]
        log.info("rank %d/%d writes %d of %d weight files", self.rank, self.world, len(mine), len(outputs.files))
        reports = self.everywhere(lambda: write_share(job, prepared, mine, show_progress=show_progress and self.lead))
        everyone: list[tuple[WriteReport, int] | None] = [None] * self.world
        with _peers_answer():
            dist.all_gather_object(everyone, (reports, peak_rss_bytes()))
        whole = gathered(outputs.files, [report for report, _ in everyone])
        return Written(whole, max(peak for _, peak in everyone), "peak RSS (largest rank)")


@contextlib.contextmanager
def torchrun_ranks(timeout_seconds: float | None = None) -> Iterator[TorchrunRanks]:
    """This process and its peers as the workers, for the block: the process group is open while they merge.

    A rank waits at most ``timeout_seconds`` (default: see ``dist_timeout``) for the others."""
    with _process_group(timeout_seconds) as (rank, world):
        yield TorchrunRanks(rank, world)


def write_as_ranks(job: WeightJob) -> Written | None:
    """The ranks of a launch whose lead is another process (Dagster's step): every rank plans, then writes
    its share into the lead's staging folder. Rank 0 returns the whole report, others ``None``.

    The wait for other ranks is $MERGE_PIPELINE_DIST_TIMEOUT (or the default)."""
    with torchrun_ranks() as ranks:
        written = plan_then_write(job, ranks)
        return written if ranks.lead else None
