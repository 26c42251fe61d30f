"""Dagster's default run launcher, plus the worker health check that run monitoring needs.

``DefaultRunLauncher`` (each run in a worker process the code server spawns) cannot tell whether a run's
worker is alive: a worker killed by SIGKILL or the kernel's OOM killer leaves its run STARTED forever, so
the instance's run retries never see a failure to retry, and a merge killed at 90 % is never resumed.
With this launcher and ``run_monitoring`` on (the repo's ``dagster.yaml``), the daemon asks it every poll;
a worker that is gone marks its run failed, and ``run_retries`` starts a new run, which resumes from the
weight files the killed one finished (``pipeline.merge``).

The check looks the worker's pid up on this host: the daemon must run beside the code servers (as under
``dagster dev``, or the production layout of docs/DAGSTER.md on one host). Code servers on other hosts
need a launcher with a health check of its own (Kubernetes, Docker, ECS).
"""

from __future__ import annotations

import psutil
from dagster import DagsterEventType, DagsterRun, DefaultRunLauncher
from dagster._core.launcher import CheckRunHealthResult, WorkerStatus  # the interface's own types: no public name

WORKER_STARTED = "Started process for run"  # the code server's engine event, with the worker's pid


class MonitoredRunLauncher(DefaultRunLauncher):
    @property
    def supports_check_run_worker_health(self) -> bool:
        return True

    def check_run_worker_health(self, run: DagsterRun) -> CheckRunHealthResult:
        started = self._worker_started(run)
        if started is None:  # no worker recorded yet: nothing to judge, so not a failure
            return CheckRunHealthResult(WorkerStatus.RUNNING, "no run worker recorded yet")
        pid, when = started
        try:
            worker = psutil.Process(pid)
            # A pid reused by a process started after the worker is not the worker.
            alive = worker.create_time() <= when + 1 and worker.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            alive = False
        if alive:
            return CheckRunHealthResult(WorkerStatus.RUNNING, f"run worker pid {pid} is running")
        return CheckRunHealthResult(
            WorkerStatus.FAILED, f"the run worker (pid {pid}) is gone: killed, or out of memory"
        )

    def _worker_started(self, run: DagsterRun) -> tuple[int, float] | None:
        """The pid and start time of the run's newest worker: the code server's "Started process for run"."""
        for record in reversed(self._instance.all_logs(run.run_id, of_type=DagsterEventType.ENGINE_EVENT)):
            event = record.dagster_event
            # Only the run's worker: step subprocesses of a multiprocess executor record pids too.
            if event and event.message and event.message.startswith(WORKER_STARTED):
                return int(event.engine_event_data.metadata["pid"].value), record.timestamp
        return None
