"""The production variant of docs/DAGSTER.md, run as written there: PostgreSQL storage (Debian's server,
started here on 127.0.0.1), the code location as its own gRPC code server, ``dagster-webserver`` and
``dagster-daemon`` as separate processes, run monitoring on with the project's launcher. A checkpoint
dropped into the watched root is merged by the sensor and published; a merge queued by ``dagster job
launch`` whose worker is SIGKILLed is marked failed by run monitoring, retried, and the retry resumes it."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from merge_pipeline.dagster.resources import MergeSettings
from merge_pipeline.watch.partitions import checkpoint_key
from merge_pipeline_tests.dagster.helpers import PROJECT_ROOT
from merge_pipeline_tests.dagster.postgres import running_postgres
from merge_pipeline_tests.dagster.services import (
    VENV_BIN,
    Dagster,
    free_port,
    start_service,
    stop_group,
    wait_until_serving,
)
from merge_pipeline_tests.dagster.test_dagster_resume import (
    SHARDS,
    drop_and_wait_for_the_sensors_merge,
    kill_the_worker_and_check_the_retry_resumes,
    write_killable_checkpoint,
)
from merge_pipeline_tests.helpers import load_safetensors_dir, same_bits

pytestmark = pytest.mark.e2e

DOCS = PROJECT_ROOT / "docs" / "DAGSTER.md"
DOCUMENTED_PORTS = {"grpc": "4000", "webserver": "3000"}


def documented_block(first_line: str) -> str:
    """The code block of docs/DAGSTER.md whose first line is ``first_line``."""
    blocks = re.findall(r"^```\w*\n(.*?)^```", DOCS.read_text(), re.M | re.S)
    [block] = [b for b in blocks if b.startswith(first_line)]
    return block


def production_instance(home: Path) -> None:
    """``$DAGSTER_HOME`` as the docs describe it: the project's dagster.yaml plus the Postgres storage,
    and a workspace.yaml naming the code server."""
    settings = yaml.safe_load((PROJECT_ROOT / "dagster.yaml").read_text())
    settings |= yaml.safe_load(documented_block("# $DAGSTER_HOME/dagster.yaml"))
    (home / "dagster.yaml").write_text(yaml.safe_dump(settings))
    (home / "workspace.yaml").write_text(documented_block("# $DAGSTER_HOME/workspace.yaml"))


def documented_commands(ports: dict[str, int]) -> list[list[str]]:
    """The docs' commands, one service each, on this test's free ports and 127.0.0.1."""
    commands = []
    for line in documented_block("# production:").splitlines():
        line = line.split("  #")[0].strip()
        if line and not line.startswith("#"):
            for name, port in DOCUMENTED_PORTS.items():
                line = line.replace(f" {port}", f" {ports[name]}")
            commands.append(shlex.split(line.replace("0.0.0.0", "127.0.0.1")))
    return commands


@pytest.fixture(scope="module")
def production(tmp_path_factory):
    base = tmp_path_factory.mktemp("production")
    settings = MergeSettings(
        checkpoint_roots=[str(base / "checkpoints")], output_root=str(base / "merged"), settle_seconds=3600
    )
    home, logs = base / "dagster_home", base / "logs"
    home.mkdir()
    logs.mkdir()
    ports = {"grpc": free_port(), "webserver": free_port()}
    production_instance(home)
    workspace = yaml.safe_load((home / "workspace.yaml").read_text())
    workspace["load_from"][0]["grpc_server"]["port"] = ports["grpc"]
    (home / "workspace.yaml").write_text(yaml.safe_dump(workspace))
    written, reference = write_killable_checkpoint(base, unsharded=base / "unsharded")
    with running_postgres() as postgres:
        env = {
            "PATH": f"{VENV_BIN}:/usr/bin:/bin",
            "HOME": str(base),
            "PYTHONPATH": str(PROJECT_ROOT),
            "DAGSTER_HOME": str(home),
            "DAGSTER_DISABLE_TELEMETRY": "1",
            "MERGE_PIPELINE_CHECKPOINT_ROOTS": settings.checkpoint_roots[0],
            "MERGE_PIPELINE_OUTPUT_ROOT": settings.output_root,
            "MERGE_PIPELINE_SETTLE_SECONDS": "3600",
            "MERGE_PIPELINE_SENSOR_INTERVAL_SECONDS": "2",
            **postgres.env(),
        }
        migrate, *services = documented_commands(ports)
        assert migrate == ["dagster", "instance", "migrate"], migrate
        migrated = subprocess.run(migrate, cwd=home, env=env, capture_output=True, text=True, timeout=300)
        assert migrated.returncode == 0, migrated.stdout[-3000:] + migrated.stderr[-3000:]
        dagster = Dagster(f"http://127.0.0.1:{ports['webserver']}", home, [])
        started = []
        try:
            for command in services:  # the code server first: the webserver and the daemon load it over gRPC
                log = logs / f"{Path(command[0]).name}_{len(started)}.log"
                dagster.logs.append(log)
                started.append(start_service(command, home, env, log))
            wait_until_serving(dagster, started, timeout=300)
            dagster.wait_for_sensor_tick("new_checkpoint_sensor")
            yield dagster, settings, written, reference, env, base
        finally:
            for process in reversed(started):
                stop_group(process)


def test_the_sensor_merges_a_dropped_checkpoint_with_postgres_storage(production):
    dagster, settings, written, _, env, base = production
    key = checkpoint_key("prod/global_step_1/actor")

    drop_and_wait_for_the_sensors_merge(dagster, settings, written, key)

    merged, unsharded = load_safetensors_dir(settings.target_dir(key)), load_file(base / "unsharded/model.safetensors")
    assert set(merged) == set(unsharded) and all(same_bits(merged[n], t) for n, t in unsharded.items())
    runs = dagster.partition_runs(str(key), "merge_checkpoint")
    assert [r["status"] for r in runs] == ["SUCCESS"]
    assert {"key": "merge_pipeline/heavy", "value": "merge"} in runs[0]["tags"]
    # the run and its events are in PostgreSQL, not in sqlite files of the instance folder
    assert not list(Path(env["DAGSTER_HOME"]).rglob("*.db"))


def test_a_queued_merge_whose_worker_is_killed_is_retried_and_resumes(production):
    dagster, settings, written, reference, env, _ = production
    key = checkpoint_key("prod_resume/global_step_1/actor")
    drop_and_wait_for_the_sensors_merge(dagster, settings, written, key)
    config = {"ops": {"hf_model": {"config": {"overwrite": True, **SHARDS}}}}

    def launch() -> str:
        run_id = str(uuid.uuid4())
        launched = subprocess.run(
            [
                "dagster",
                "job",
                "launch",
                "-w",
                "workspace.yaml",
                "-j",
                "merge_checkpoint",
                "--tags",
                json.dumps({"dagster/partition": str(key)}),
                "--config-json",
                json.dumps(config),
                "--run-id",
                run_id,
            ],
            cwd=env["DAGSTER_HOME"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert launched.returncode == 0, launched.stderr[-3000:]
        return run_id

    killed_run = kill_the_worker_and_check_the_retry_resumes(dagster, launch, settings.target_dir(key), reference)
    happened = dagster.event_types(killed_run)  # it went through the run queue, as docs/DAGSTER.md says
    queue = [t for t in happened if t in ("RunEnqueuedEvent", "RunStartingEvent")]
    assert queue == ["RunEnqueuedEvent", "RunStartingEvent"], happened
