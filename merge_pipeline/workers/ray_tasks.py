"""Merging on a Ray cluster (``merge --ray-address``, Dagster's ``launcher: ray``): the driver leads, Ray tasks write.

The driver is the process running ``pipeline.merge``: it plans, holds the target's lock, keeps what a
killed merge finished, writes the side files, checks and publishes, as every launcher's lead does.
``RayTasks.write`` hands the weight files to Ray tasks, each a set of whole output files (balanced by
bytes: ``writing.assign_shards``), spread over the nodes, each reserving one CPU and the memory its
files need. A task plans the checkpoint itself (metadata only), writes its files into the staging
folder beside the target (``remote.plan_then_write``, as torchrun's ranks do) (the nodes share that filesystem at the same path, as torchrun's ranks do)
and returns its write report, the bytes it read and its peak RSS.

A task whose node or worker dies is run again by Ray on another node (``max_retries``): it keeps the
files it recorded as finished and writes the others from their first byte (the writer truncates), so
the folder is byte-identical to a one-process merge. The driver watches the staging folder for progress,
and fails in one line when no byte was written for ``timeout`` seconds.

A node has its own environment, not the driver's: each task gets the variables the store and the Hub
read from the driver's (``RaySettings.forwarded_env``: Ray's ``runtime_env`` ``env_vars``), named in
the log, their values never.

Ray is imported here only, when a merge runs: ``pip install 'merge_pipeline[ray]'``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import merge_pipeline
from merge_pipeline.engine.safetensors_writer import BUFFERED_BYTES, build_header
from merge_pipeline.errors import MergeError, first_line, os_error
from merge_pipeline.formats.coalesced_reads import GROUP_BYTES
from merge_pipeline.plan import READ_PIECE_BYTES
from merge_pipeline.progress import ByteProgress, human_bytes
from merge_pipeline.ray_settings import RaySettings
from merge_pipeline.store.url import is_store_url
from merge_pipeline.workers.in_process import Workers
from merge_pipeline.workers.ray_probe import check_ray_head
from merge_pipeline.workers.remote import plan_then_write
from merge_pipeline.workers.writing import (
    Prepared,
    ShardFile,
    WeightJob,
    WriteReport,
    Written,
    assign_shards,
    gathered,
    peak_rss_bytes,
    write_share,
)

log = logging.getLogger("merge_pipeline")

# A task's process before it reads a tensor: Python, torch, the plan (measured ~0.5 GB; a large
# checkpoint's plan adds to it). With the largest tensor twice (a concatenation holds its parts and the
# result) and the read and write buffers, what a task reserves unless --ray-memory-per-task says.
PROCESS_BYTES = 1 << 30
READ_BUFFERS = BUFFERED_BYTES + READ_PIECE_BYTES + GROUP_BYTES
_POLL_SECONDS = 1.0
_CANCEL_WAIT_SECONDS = 60
_PACKAGE = Path(merge_pipeline.__file__).parent  # shipped to the cluster: its tasks run the driver's code


@dataclass(frozen=True)
class TaskResult:
    """What one write task sends back: its report, or the one line of its failure."""

    node_id: str
    node_ip: str
    report: WriteReport | None = None
    bytes_read: int = 0  # tensor bytes read from the checkpoint's files by this task's writing
    peak_rss_bytes: int = 0
    cpu_s: float = 0.0  # user + system CPU of the task's worker process, start-up included
    error: str | None = None

    @property
    def node(self) -> str:
        return f"{self.node_ip} ({self.node_id[:8]})"


def _ray():
    try:
        import ray
    except ImportError:
        raise MergeError(None, "merging on a Ray cluster needs Ray: pip install 'merge_pipeline[ray]'") from None
    return ray


@contextlib.contextmanager
def _connected(ray, address: str) -> Iterator[None]:
    """Connected to the cluster for the block, unless this process already is (a script: its job's code runs)."""
    if ray.is_initialized():
        yield
        return
    _connect(ray, address)
    try:
        yield
    finally:
        ray.shutdown()


def _connect(ray, address: str) -> None:
    check_ray_head(address)
    on_sigterm = signal.getsignal(signal.SIGTERM)
    try:
        # the driver's own merge_pipeline goes with the job: every task runs the code that planned it
        ray.init(
            address=address,
            runtime_env={"py_modules": [str(_PACKAGE)]},
            logging_level=logging.WARNING,
            log_to_driver=True,
        )
    except Exception as exc:  # ConnectionError (no cluster), RuntimeError (Ray or Python version mismatch), ...
        raise MergeError(None, f"Ray cluster at {address}: {exc}") from None
    finally:
        # ray.init replaces the driver's SIGTERM handler with a bare exit: the CLI's (or Dagster's) unwinds
        # the merge, cancelling the tasks and removing the staging folder and lock
        if on_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, on_sigterm)


class RayTasks(Workers):
    """The driver leads in its own process; Ray tasks write the weight files."""

    def __init__(self, settings: RaySettings, logger: Any = log):
        """Checks that Ray is installed and the head answers, before any work. ``logger``: where the
        driver reports (the module's logger, or a Dagster run's)."""
        _ray()
        check_ray_head(settings.address)
        self.settings, self.log = settings, logger
        self.results: list[TaskResult] = []  # of the last write: per task, in the order of ``shares``

    def write(self, job: WeightJob, prepared: Prepared, *, show_progress: bool) -> Written:
        ray = _ray()
        with _connected(ray, self.settings.address):
            return self._write(ray, job, prepared, show_progress)

    def _write(self, ray, job: WeightJob, prepared: Prepared, show_progress: bool) -> Written:
        job = job.planned_as(prepared)
        files = prepared.outputs.files
        request = self._request(files)
        nodes = _nodes_for(ray, request, self.settings)
        shares = [share for share in assign_shards(files, min(self.settings.tasks or len(nodes), len(files))) if share]
        self.log.info(
            "Ray: %d write tasks on %d fitting node(s) of %s, each reserving %s",
            len(shares),
            len(nodes),
            self.settings.address,
            _described(request, self.settings),
        )
        env = self.settings.forwarded_env(_uses_store(job))
        if env:  # names only: the values are credentials
            self.log.info("Ray: the write tasks get %s from this process's environment", ", ".join(sorted(env)))
        # max_calls: a fresh worker per task, so its peak RSS is the task's and its memory is returned after
        task = ray.remote(max_calls=1)(_write_task)
        options = {
            # merged with the job's runtime_env (its py_modules kept); values travel with the task, never logged
            "runtime_env": {"env_vars": env} if env else None,
            "num_cpus": self.settings.cpus_per_task,
            "memory": request["memory"],
            "resources": {self.settings.resource: 1} if self.settings.resource else None,
            "label_selector": self.settings.label_selector or None,
            "scheduling_strategy": "SPREAD",
            "max_retries": self.settings.max_retries,
            "retry_exceptions": False,  # a task's own failure is its answer: the same inputs fail the same way
        }
        refs = {
            task.options(**options, name=f"merge_pipeline write {i + 1}/{len(shares)}").remote(
                job, [f.filename for f in share]
            ): i
            for i, share in enumerate(shares)
        }
        self.results = _gather(ray, refs, shares, job.staging, request, self.settings, self.log, show_progress)
        _log_reads(self.results, self.log)
        report = gathered(files, [r.report for r in self.results])
        return Written(report, max(r.peak_rss_bytes for r in self.results), "peak RSS (largest Ray task)")

    def _request(self, files: list[ShardFile]) -> dict[str, float]:
        largest = max((t.planned.nbytes() for f in files for t in f.tensors), default=0)
        memory = self.settings.memory_bytes or PROCESS_BYTES + 2 * largest + READ_BUFFERS
        return {
            "CPU": self.settings.cpus_per_task,
            "memory": memory,
            **({self.settings.resource: 1} if self.settings.resource else {}),
        }


def _uses_store(job: WeightJob) -> bool:
    return any(is_store_url(place) for place in (job.local_dir, job.upload_to or "", *job.options.average_inputs))


def _write_task(job: WeightJob, filenames: list[str]) -> TaskResult:
    """One Ray task: plan the checkpoint, write ``filenames`` into the staging folder (keeping those a
    killed attempt or merge recorded as finished)."""
    import ray

    node_id, node_ip = ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
    task = _Task(filenames)
    try:
        if not job.staging.is_dir():
            raise MergeError(
                job.staging, "not found on this node: the Ray nodes must see the target's filesystem at the same path"
            )
        written = plan_then_write(job, task)
    except MergeError as exc:
        return TaskResult(node_id, node_ip, error=str(exc))
    except OSError as exc:
        return TaskResult(node_id, node_ip, error=str(os_error(exc)))
    usage = resource.getrusage(resource.RUSAGE_SELF)  # a fresh worker per task (max_calls=1): the task's own
    return TaskResult(
        node_id, node_ip, written.report, task.bytes_read, written.peak_rss_bytes, usage.ru_utime + usage.ru_stime
    )


class _Task(Workers):
    """A write task as a worker of its own: its files are those the driver named."""

    def __init__(self, filenames: list[str]):
        self.filenames, self.bytes_read = filenames, 0

    def write(self, job: WeightJob, prepared: Prepared, *, show_progress: bool) -> Written:
        wanted = set(self.filenames)
        files = [f for f in prepared.outputs.files if f.filename in wanted]
        if len(files) != len(wanted):
            raise MergeError(job.local_dir, "planned other weight files on this node than on the driver")
        before = _bytes_read(prepared)
        report = write_share(job, prepared, files, show_progress=show_progress)
        self.bytes_read = _bytes_read(prepared) - before
        return Written(report, peak_rss_bytes(), "peak RSS (this task)")


def _bytes_read(prepared: Prepared) -> int:
    return sum(f.bytes_read for f in prepared.plan.files)


def _nodes_for(ray, request: dict[str, float], settings: RaySettings) -> list[dict]:
    """The alive nodes that can run a write task; none: one line naming what is missing."""
    alive = [n for n in ray.nodes() if n["Alive"]]
    labels = settings.label_selector
    fitting = [
        n
        for n in alive
        if all(n["Resources"].get(k, 0) >= v for k, v in request.items())
        and all(n.get("Labels", {}).get(k) == v for k, v in labels.items())
    ]
    if fitting:
        return fitting
    missing = []
    for name, amount in request.items():
        most = max((n["Resources"].get(name, 0) for n in alive), default=0)
        if most < amount:
            missing.append(f"{_amount(name, amount)} (the most a node has: {_amount(name, most)})")
    missing += [f"label {k}={v}" for k, v in labels.items() if not any(n.get("Labels", {}).get(k) == v for n in alive)]
    why = "no node has " + "; ".join(missing) if missing else "no one node has all of it"
    raise MergeError(
        None,
        f"Ray cluster at {settings.address}: no node can run a write task, which needs {_described(request, settings)}: {why}",
    )


def _amount(name: str, amount: float) -> str:
    if name == "memory":
        return f"memory {human_bytes(amount)}"
    return f"{name} {amount:g}" if name == "CPU" else f"resource {name!r} {amount:g}"


def _described(request: dict[str, float], settings: RaySettings) -> str:
    labels = [f"label {k}={v}" for k, v in settings.label_selector.items()]
    return ", ".join([_amount(name, amount) for name, amount in request.items()] + labels)


def _gather(
    ray,
    refs: dict,
    shares: list[list[ShardFile]],
    staging: Path,
    request: dict[str, float],
    settings: RaySettings,
    logger: Any,
    show_progress: bool,
) -> list[TaskResult]:
    """Wait for every task, reporting progress; the first failure cancels the rest and is raised in one line."""
    results: list[TaskResult | None] = [None] * len(shares)
    watch = _StagingWatch(staging, [f for share in shares for f in share], show_progress)
    nodes = _alive(ray)
    pending = dict(refs)
    try:
        while pending:
            done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=_POLL_SECONDS, fetch_local=False)
            for ref in done:
                i = pending.pop(ref)
                results[i] = _result(ray, ref, i, shares, settings)
                logger.info(
                    "Ray task %d/%d on %s wrote %d weight file(s), %s, reading %s (peak RSS %s, CPU %.1f s)",
                    i + 1,
                    len(shares),
                    results[i].node,
                    len(shares[i]),
                    human_bytes(results[i].report.bytes),
                    human_bytes(results[i].bytes_read),
                    human_bytes(results[i].peak_rss_bytes),
                    results[i].cpu_s,
                )
            nodes = _note_lost_nodes(ray, nodes, settings, logger)
            stalled = watch.poll()
            if pending and stalled > settings.timeout:
                raise MergeError(
                    None,
                    f"Ray: no weight byte written for {stalled:.0f} s (--ray-timeout) by {len(pending)} task(s) each needing"
                    f" {_described(request, settings)}; free on the cluster now: {_free(ray, request)}",
                )
    except BaseException:
        _cancel(ray, pending, logger)
        raise
    finally:
        watch.close()
    return results


def _result(ray, ref, i: int, shares: list[list[ShardFile]], settings: RaySettings) -> TaskResult:
    try:
        result = ray.get(ref)
    except ray.exceptions.RayError as exc:  # its node or worker died once more than max_retries allow, ...
        raise MergeError(
            None,
            f"Ray task {i + 1}/{len(shares)} ({len(shares[i])} weight files) failed"
            f" (retried up to {settings.max_retries} times): {first_line(exc)}",
        ) from None
    if result.error is not None:
        raise MergeError(None, f"on Ray node {result.node_ip}: {result.error}")
    return result


def _free(ray, request: dict[str, float]) -> str:
    """What the cluster has free now of each thing a task asks for (all nodes together)."""
    free = ray.available_resources()  # a resource in use to the last unit is left out
    return ", ".join(_amount(name, free.get(name, 0)) for name in request)


def _alive(ray) -> dict[str, str]:
    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}


def _note_lost_nodes(ray, known: dict[str, str], settings: RaySettings, logger: Any) -> dict[str, str]:
    now = _alive(ray)
    for node_id in known.keys() - now.keys():
        logger.warning(
            "Ray node %s (%s) left the cluster: Ray runs its unfinished write tasks again on other nodes (up to %d times)",
            known[node_id],
            node_id[:8],
            settings.max_retries,
        )
    return now


def _cancel(ray, pending: dict, logger: Any) -> None:
    """Stop the tasks still running before the staging folder is removed: none may write into it after."""
    if not pending:
        return
    for ref in pending:
        ray.cancel(ref, force=True)
    _, still = ray.wait(list(pending), num_returns=len(pending), timeout=_CANCEL_WAIT_SECONDS, fetch_local=False)
    if still:
        logger.warning(
            "Ray: %d write task(s) did not stop within %d s of being cancelled", len(still), _CANCEL_WAIT_SECONDS
        )


def _log_reads(results: list[TaskResult], logger: Any) -> None:
    by_node: dict[str, list[TaskResult]] = defaultdict(list)
    for r in results:
        by_node[r.node].append(r)
    total = sum(r.bytes_read for r in results)
    logger.info(
        "Ray: read %s of the checkpoint in all; per node: %s",
        human_bytes(total),
        "; ".join(
            f"{node} {human_bytes(sum(r.bytes_read for r in done))} by {len(done)} task(s)"
            for node, done in sorted(by_node.items())
        ),
    )


class _StagingWatch:
    """Progress of the tasks' writing, as the staging folder shows it (the nodes share it): the bytes of
    the weight files there, each counted up to its largest size seen (a retried file is rewritten)."""

    def __init__(self, staging: Path, files: list[ShardFile], show_progress: bool):
        self.paths = [staging / f.filename for f in files]
        self.seen = {path: 0 for path in self.paths}
        total = sum(len(build_header(f.tensors)) + f.nbytes for f in files)  # the files' sizes, headers included
        self.progress = ByteProgress(total, "writing weights on Ray", done=self._sizes(), enabled=show_progress)
        self.last_change = time.monotonic()

    def _sizes(self) -> int:
        for path in self.paths:
            with contextlib.suppress(OSError):
                self.seen[path] = max(self.seen[path], os.stat(path).st_size)
        return sum(self.seen.values())

    def poll(self) -> float:
        """Seconds since the last byte was written."""
        before = sum(self.seen.values())
        grown = self._sizes() - before
        if grown:
            self.progress(grown)
            self.last_change = time.monotonic()
        return time.monotonic() - self.last_change

    def close(self) -> None:
        self.progress.close()
