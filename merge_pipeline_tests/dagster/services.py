"""Start a real ``dagster dev`` for a test, talk to it over GraphQL, and always stop it.

It runs in its own session (so its process group holds it and every child it starts, run
workers included) with SIGINT at its default disposition: a process started in the background
inherits an ignored SIGINT and would then shut down on nothing but SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

from merge_pipeline_tests.dagster.helpers import PROJECT_ROOT

VENV_BIN = Path(sys.executable).parent
T = TypeVar("T")

SENSOR_TICKS_QUERY = """
query Ticks($sensor: SensorSelector!) {
  sensorOrError(sensorSelector: $sensor) { ... on Sensor { sensorState { ticks(limit: 1) { status } } } }
}"""
LOCATIONS_QUERY = (
    "{ workspaceOrError { ... on Workspace { locationEntries { name locationOrLoadError { __typename } } } } }"
)
RUNS_QUERY = """
query Runs($filter: RunsFilter) {
  runsOrError(filter: $filter) { ... on Runs { results { runId status startTime endTime tags { key value } } } }
}"""
RUN_QUERY = """
query Run($runId: ID!) { runOrError(runId: $runId) { ... on Run { status } } }"""
MESSAGES_QUERY = """
query Events($runId: ID!) { logsForRun(runId: $runId) { ... on EventConnection { events { ... on MessageEvent { message } } } } }"""
EVENT_TYPES_QUERY = """
query Events($runId: ID!) { logsForRun(runId: $runId) { ... on EventConnection { events { __typename } } } }"""
MATERIALIZED_QUERY = """
query Events($runId: ID!) { logsForRun(runId: $runId) { ... on EventConnection { events {
  ... on MaterializationEvent { assetKey { path } metadataEntries { label
    ... on TextMetadataEntry { text } ... on FloatMetadataEntry { floatValue } ... on IntMetadataEntry { intValue } } } } } } }"""
ENDED = ("SUCCESS", "FAILURE", "CANCELED")


@dataclass
class Dagster:
    url: str
    home: Path
    logs: list[Path]

    def graphql(self, query: str, variables: dict) -> dict:
        request = urllib.request.Request(
            f"{self.url}/graphql",
            data=json.dumps({"query": query, "variables": variables}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            body = json.load(response)
        assert "errors" not in body, body["errors"]
        return body["data"]

    def partition_runs(self, partition_key: str, job: str | None = None, tags: dict | None = None) -> list[dict]:
        """The partition's runs, newest first; ``job``: of that job only; ``tags``: with these tags."""
        tags = [{"key": k, "value": v} for k, v in {"dagster/partition": partition_key, **(tags or {})}.items()]
        runs_filter = {"tags": tags, **({"pipelineName": job} if job else {})}
        return self.graphql(RUNS_QUERY, {"filter": runs_filter})["runsOrError"]["results"]

    def wait_for_sensor_tick(self, sensor: str, timeout: float = 240) -> None:
        """Until the daemon has evaluated ``sensor`` once: from then on a new checkpoint meets a running system."""
        selector = {
            "repositoryLocationName": "merge_pipeline",
            "repositoryName": "__repository__",
            "sensorName": sensor,
        }
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.graphql(SENSOR_TICKS_QUERY, {"sensor": selector})["sensorOrError"]
            if found.get("sensorState", {}).get("ticks"):
                return
            time.sleep(0.5)
        raise TimeoutError(f"sensor {sensor} not evaluated after {timeout} s\n{self.log_tail()}")

    def messages(self, run_id: str) -> list[str]:
        events = self.graphql(MESSAGES_QUERY, {"runId": run_id})["logsForRun"]["events"]
        return [e["message"] for e in events if e.get("message")]

    def materialized(self, run_id: str, asset: str) -> dict[str, str | float | int]:
        """The text and number metadata of ``asset``'s materialization in the run (label -> value)."""
        events = self.graphql(MATERIALIZED_QUERY, {"runId": run_id})["logsForRun"]["events"]
        [event] = [e for e in events if (e.get("assetKey") or {}).get("path") == [asset]]
        kinds = ("text", "floatValue", "intValue")
        return {m["label"]: m[k] for m in event["metadataEntries"] for k in kinds if m.get(k) is not None}

    def event_types(self, run_id: str) -> list[str]:
        """The GraphQL types of the run's events, in order (``RunEnqueuedEvent``, ``RunStartingEvent``, ...)."""
        events = self.graphql(EVENT_TYPES_QUERY, {"runId": run_id})["logsForRun"]["events"]
        return [e["__typename"] for e in events]

    def outcome(self, run_id: str) -> str | None:
        """The run's status once it ended, else None."""
        status = self.graphql(RUN_QUERY, {"runId": run_id})["runOrError"]["status"]
        return status if status in ENDED else None

    def ended_run(self, partition_key: str, job: str) -> dict | None:
        """The partition's newest run of ``job`` once it ended, else None."""
        runs = self.partition_runs(partition_key, job)
        return runs[0] if runs and runs[0]["status"] in ENDED else None

    def retry_of(self, run_id: str) -> str | None:
        """The run the instance's run retries started for ``run_id``, if any yet."""
        tags = [{"key": "dagster/parent_run_id", "value": run_id}]
        runs = self.graphql(RUNS_QUERY, {"filter": {"tags": tags}})["runsOrError"]["results"]
        return runs[0]["runId"] if runs else None

    def worker_pid(self, run_id: str) -> int | None:
        """The pid of the run's worker, from the code server's "Started process for run" event."""
        for message in self.messages(run_id):
            if found := re.match(r"Started process for run \(pid: (\d+)\)", message):
                return int(found[1])
        return None

    def wait_for(self, what: str, found: Callable[[], T | None], timeout: float = 240, every: float = 0.5) -> T:
        """``found()``'s first value that is not None; the test fails, with the servers' logs, after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (value := found()) is not None:
                return value
            time.sleep(every)
        pytest.fail(f"{what}: not after {timeout} s\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-chars:]}" for p in self.logs)


def clean_copy(destination) -> None:
    """The project's files as a fresh clone has them: tracked and not ignored, no .venv, no instance."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=PROJECT_ROOT, capture_output=True, check=True
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        if (PROJECT_ROOT / name).is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(PROJECT_ROOT / name, destination / name)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def running_dagster_dev(
    project: Path, env: dict[str, str], log: Path, *, command: str = "dagster", start_timeout: float = 300
) -> Iterator[Dagster]:
    """Plain ``dagster dev`` (or ``dg dev``) in ``project`` on 127.0.0.1, as a user starts it: no
    DAGSTER_HOME, no -w; stopped on exit whatever happens. Its instance lives in the
    ``.tmp_dagster_home_*`` folder it makes."""
    port = free_port()
    dagster = Dagster(f"http://127.0.0.1:{port}", project, [log])
    env = {k: v for k, v in {**os.environ, **env}.items() if k != "DAGSTER_HOME"}
    process = start_service(
        [str(VENV_BIN / command), "dev", "--host", "127.0.0.1", "--port", str(port)], project, env, log
    )
    try:
        wait_until_serving(dagster, [process], start_timeout)
        yield dagster
    finally:
        stop_group(process)


def start_service(command: list[str], cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    """A Dagster process in its own session (its group holds every child it starts), SIGINT at its
    default disposition, its output in ``log``; stop it with ``stop_group``."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            command,
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_default_sigint,
        )


def stop_group(process: subprocess.Popen, grace: float = 30) -> None:
    """SIGINT to the process group (Dagster shuts its children down), then SIGKILL to whatever is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGINT)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _group_alive(process):
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _group_alive(process: subprocess.Popen) -> bool:
    process.poll()  # reap the leader once it exits, so it stops counting as a member
    try:
        os.killpg(process.pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_until_serving(dagster: Dagster, processes: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in processes):
            raise RuntimeError(f"a Dagster process exited while starting\n{dagster.log_tail()}")
        with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError):
            with urllib.request.urlopen(f"{dagster.url}/server_info", timeout=5):
                return
        time.sleep(0.5)
    raise TimeoutError(f"dagster-webserver not serving after {timeout} s\n{dagster.log_tail()}")
