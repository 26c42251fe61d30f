"""Merging on a real multi-node Ray cluster (``merge --ray-address``): tasks on several nodes, a node killed
mid-merge, the same bytes as one process; a bad address or an impossible request in one line."""

from __future__ import annotations

import contextlib
import http.server
import logging
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from local_servers.ray_cluster import MERGE_RESOURCE, add_worker, free_port, local_cluster, write_tasks
from merge_pipeline.engine.publish import lock_path, staging_path
from merge_pipeline.options import MergeOptions
from merge_pipeline.pipeline.merge import merge
from merge_pipeline.ray_settings import RaySettings
from merge_pipeline.workers.ray_tasks import RayTasks
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.helpers import cli_merge_command, error_lines, run_cli, tree_digest

SHARDS = "200KB"  # several weight files from the small samples: something to spread over the nodes


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(workers=2) as started:
        yield started


def merged_on_ray(address: str, local_dir: Path, target: Path, options: MergeOptions, **settings) -> RayTasks:
    workers = RayTasks(RaySettings(address=address, **settings))
    merge(local_dir, target, options, workers=workers, show_progress=False)
    return workers


def assert_same_as_one_process(target: Path, local_dir: Path, options: MergeOptions, tmp_path: Path) -> None:
    merge(local_dir, tmp_path / "one_process", options, show_progress=False)
    assert tree_digest(target) == tree_digest(tmp_path / "one_process")  # the manifest too: same inputs, options


def samples(request, name: str) -> tuple[Path, MergeOptions]:
    """The checkpoint folder and its options: FSDP (also quantized to NVFP4A16: a global scale each fused set's
    members share across tasks), Megatron-Core (verl's v2 layout), torchtitan's DCP."""
    if name == "fsdp":
        return request.getfixturevalue("fsdp_checkpoint")(FsdpSpec()).role_dir, MergeOptions(max_shard_size=SHARDS)
    if name == "fsdp_nvfp4":
        role_dir = request.getfixturevalue("fsdp_checkpoint")(FsdpSpec()).role_dir
        return role_dir, MergeOptions(max_shard_size=SHARDS, quantize="NVFP4A16")
    if name == "megatron":
        sample = request.getfixturevalue("megatron_v2_sample")
        return sample.role_dir, MergeOptions(max_shard_size=SHARDS, hf_model_path=str(sample.original_dir))
    sample = request.getfixturevalue("dcp_sample")("torchtitan")
    return sample.folder, MergeOptions(max_shard_size=SHARDS, hf_model_path=str(sample.original_dir))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp", "fsdp_nvfp4", "megatron", "dcp"])
def test_tasks_on_several_nodes_write_what_one_process_writes(request, cluster, tmp_path, name):
    local_dir, options = samples(request, name)
    before = {t.task_id for t in write_tasks(cluster)}

    workers = merged_on_ray(cluster.address, local_dir, tmp_path / "out", options)

    assert_same_as_one_process(tmp_path / "out", local_dir, options, tmp_path)
    ours = [t for t in write_tasks(cluster) if t.task_id not in before]
    assert len(ours) == 2 and all(t.state == "FINISHED" for t in ours)
    assert len({t.node_id for t in ours}) == 2, "Ray's records: the tasks ran on two nodes"
    assert {r.node_id for r in workers.results} == {t.node_id for t in ours}
    assert all(r.bytes_read > 0 and r.peak_rss_bytes > 0 and r.cpu_s > 0 for r in workers.results)


@pytest.mark.slow
def test_cli_merges_over_the_cluster_and_reports_each_task(capsys, caplog, cluster, fsdp_checkpoint, tmp_path):
    caplog.set_level(logging.INFO, logger="merge_pipeline")
    local_dir = fsdp_checkpoint(FsdpSpec()).role_dir
    target = tmp_path / "out"

    code, out, err = run_cli(
        capsys,
        "merge",
        "--local_dir",
        local_dir,
        "--target_dir",
        target,
        "--no-progress",
        "--max-shard-size",
        SHARDS,
        "--ray-address",
        cluster.address,
        "--ray-resource",
        MERGE_RESOURCE,
    )

    assert code == 0, err
    assert out.startswith("merged ")
    assert "Ray task 1/2 on " in caplog.text and "Ray task 2/2 on " in caplog.text and "per node: " in caplog.text
    assert len(re.findall(r"\(peak RSS [\d.]+ [KMG]iB, CPU [\d.]+ s\)", caplog.text)) == 2  # each task's own
    assert_same_as_one_process(target, local_dir, MergeOptions(max_shard_size=SHARDS), tmp_path)


@pytest.mark.slow
def test_a_node_killed_mid_merge_costs_its_task_and_the_folder_is_bit_exact(cluster, fsdp_checkpoint, tmp_path):
    """Three tasks, one per node (each node offers one unit of ``merge``); the third node dies while its
    task is on it: Ray runs that task again on a surviving node."""
    local_dir, options = fsdp_checkpoint(FsdpSpec()).role_dir, MergeOptions(max_shard_size="100KB")
    victim = add_worker(cluster)
    before = {t.task_id for t in write_tasks(cluster)}
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["workers"] = merged_on_ray(
                cluster.address, local_dir, tmp_path / "out", options, resource=MERGE_RESOURCE, tasks=3
            )
        except BaseException as exc:  # noqa: BLE001 (reported by the assertion below)
            outcome["error"] = exc

    merging = threading.Thread(target=run)
    merging.start()
    deadline = time.monotonic() + 120
    while not any(t.node_id == victim.node_id and t.task_id not in before for t in write_tasks(cluster, settled=False)):
        assert merging.is_alive() and time.monotonic() < deadline, "no task was placed on the third node"
        time.sleep(0.2)
    cluster.remove_node(victim, allow_graceful=False)
    merging.join(timeout=300)

    assert "error" not in outcome, outcome.get("error")
    assert_same_as_one_process(tmp_path / "out", local_dir, options, tmp_path)
    ours = [t for t in write_tasks(cluster) if t.task_id not in before]
    # each task's last attempt (a retry placed while the node was still being removed may fail in turn)
    last = {t.task_id: t for t in sorted(ours, key=lambda t: t.attempt_number)}
    retried = [t for t in last.values() if t.attempt_number > 0]
    assert retried and all(t.state == "FINISHED" and t.node_id != victim.node_id for t in retried), retried
    assert victim.node_id not in {r.node_id for r in outcome["workers"].results}


def cli_merge(capsys, local_dir: Path, target: Path, *flags) -> tuple[int, str, str]:
    return run_cli(capsys, "merge", "--local_dir", local_dir, "--target_dir", target, "--no-progress", *flags)


def cli_write(capsys, command: str, source: Path, target: Path, *flags) -> tuple[int, str, str]:
    """``merge`` of ``source``, or ``average`` of it and a sibling, into ``target``."""
    inputs = ("--local_dir", source) if command == "merge" else ("--inputs", source, f"{source}_2")
    return run_cli(capsys, command, *inputs, "--target_dir", target, "--no-progress", *flags)


@pytest.mark.parametrize("command", ["merge", "average"])
def test_an_unreachable_address_is_one_line(capsys, tmp_path, command):
    (tmp_path / "checkpoint").mkdir()

    code, _, err = cli_write(capsys, command, tmp_path / "checkpoint", tmp_path / "out", "--ray-address", "127.0.0.1:1")

    assert code == 1
    assert error_lines(err) == [
        "error: Ray cluster at 127.0.0.1:1: cannot connect (Connection refused); is its head running?"
    ]
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["merge", "average"])
def test_ray_settings_without_an_address_are_refused(capsys, tmp_path, command):
    code, _, err = cli_write(capsys, command, tmp_path, tmp_path / "out", "--ray-tasks", "2")

    assert code == 1 and error_lines(err) == ["error: --ray-tasks needs --ray-address"]


def test_the_tasks_get_the_store_variables_set_here_or_those_named():
    here = {"AWS_ACCESS_KEY_ID": "k", "HF_TOKEN": "t", "MERGE_PIPELINE_PART_BYTES": "1", "HOME": "/root", "OTHER": "o"}

    assert RaySettings().forwarded_env(True, here) == {k: here[k] for k in here if k not in ("HOME", "OTHER")}
    assert RaySettings().forwarded_env(False, here) == {}  # a merge between local folders needs none of them
    named = RaySettings(env_vars=["OTHER", "UNSET"])
    assert named.forwarded_env(True, here) == named.forwarded_env(False, here) == {"OTHER": "o"}
    assert RaySettings(env_vars=[]).forwarded_env(True, here) == {}


def test_a_bad_variable_name_is_one_line(capsys, tmp_path):
    code, _, err = cli_merge(capsys, tmp_path, tmp_path / "out", "--ray-address", "h:1", "--ray-env-vars", "A", "B-C")

    assert code == 1 and error_lines(err) == ["error: --ray-env-vars 'B-C': not an environment variable's name"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, missing",
    [
        (
            ["--ray-resource", "merge_cpu"],
            "no node has resource 'merge_cpu' 1 (the most a node has: resource 'merge_cpu' 0)",
        ),
        (["--ray-memory-per-task", "100TB"], "no node has memory 90.95 TiB (the most a node has: memory "),
        (["--ray-node-label", "pool=merge"], "no node has label pool=merge"),
    ],
)
def test_a_request_no_node_can_satisfy_is_one_line_naming_what_is_missing(
    capsys, cluster, fsdp_checkpoint, tmp_path, flags, missing
):
    code, _, err = cli_merge(
        capsys, fsdp_checkpoint(FsdpSpec()).role_dir, tmp_path / "out", "--ray-address", cluster.address, *flags
    )

    assert code == 1
    [line] = error_lines(err)
    assert line.startswith(
        f"error: Ray cluster at {cluster.address}: no node can run a write task, which needs CPU 1, "
    )
    assert missing in line
    assert "Traceback" not in err and not (tmp_path / "out").exists()
    assert not staging_path(tmp_path / "out").exists()


HOLD_EVERY_MERGE_SLOT = """
import sys, ray
ray.init(address=sys.argv[1])
Holder = ray.remote(num_cpus=0, resources={"merge": 1})(type("Holder", (), {"ready": lambda self: True}))
holders = [Holder.remote() for _ in range(int(sys.argv[2]))]
ray.get([h.ready.remote() for h in holders])
print("held", flush=True)
sys.stdin.read()
"""


@pytest.mark.slow
def test_tasks_that_never_start_fail_after_the_timeout_in_one_line(capsys, cluster, fsdp_checkpoint, tmp_path):
    """Another job holds every node's ``merge`` unit (a trainer's actors): the request fits the nodes, the
    tasks wait; after --ray-timeout the merge stops, naming what a task needs and what is free."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_EVERY_MERGE_SLOT, cluster.address, "2"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        code, _, err = cli_merge(
            capsys,
            fsdp_checkpoint(FsdpSpec()).role_dir,
            tmp_path / "out",
            "--ray-address",
            cluster.address,
            "--ray-resource",
            MERGE_RESOURCE,
            "--ray-timeout",
            "5",
        )
        waited = time.monotonic() - started
    finally:
        holder.communicate(timeout=60)  # its stdin closed: it ends, and Ray frees what it held

    assert code == 1 and waited < 60
    [line] = error_lines(err)
    assert line.startswith(
        "error: Ray: no weight byte written for 5 s (--ray-timeout) by 1 task(s) each needing CPU 1, "
    )
    assert "resource 'merge' 1; free on the cluster now: CPU 2, memory " in line
    assert line.endswith(", resource 'merge' 0")
    assert not (tmp_path / "out").exists() and not staging_path(tmp_path / "out").exists()


@contextlib.contextmanager
def not_a_ray_head(kind: str) -> Iterator[str]:
    """An address where something that is not a Ray head listens: a port that accepts and never speaks,
    a web server (as Ray's dashboard), or nothing at all."""
    if kind == "closed":
        yield f"127.0.0.1:{free_port()}"
    elif kind == "silent":
        with socket.create_server(("127.0.0.1", 0), backlog=64) as server:  # the kernel accepts, nobody reads
            yield f"127.0.0.1:{server.getsockname()[1]}"
    else:
        with http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler) as server:
            threading.Thread(target=server.serve_forever, daemon=True).start()
            yield f"127.0.0.1:{server.server_address[1]}"
            server.shutdown()


def assert_nothing_left(target: Path) -> None:
    assert not target.exists() and not staging_path(target).exists() and not lock_path(target).exists()


@pytest.mark.parametrize("kind", ["silent", "http", "closed"])
def test_an_address_that_is_no_ray_head_is_refused_in_seconds_before_any_work(fsdp_checkpoint, tmp_path, kind):
    """Before: a silent or web server port held the merge ~14 minutes inside ray.init, its lock and
    staging made, Ray's C++ warnings on the terminal."""
    with not_a_ray_head(kind) as address:
        started = time.monotonic()
        done = subprocess.run(
            cli_merge_command(fsdp_checkpoint(FsdpSpec()).role_dir, tmp_path / "out", "--ray-address", address),
            capture_output=True,
            text=True,
            timeout=180,
        )
        took = time.monotonic() - started

    # the probe waits 5 s at most; the rest is importing Ray and torch, slow on a loaded machine (before: ~14 min)
    assert done.returncode == 1 and took < 90, (took, done.stderr)
    [line] = done.stderr.splitlines()
    assert line.startswith(f"error: Ray cluster at {address}: ")
    if kind == "closed":
        assert line.endswith("cannot connect (Connection refused); is its head running?")
    else:
        assert "not answered as by a Ray head's GCS port within 5 s" in line
    assert_nothing_left(tmp_path / "out")


@pytest.mark.slow
def test_sigterm_while_waiting_on_tasks_cancels_them_and_removes_staging_and_lock(cluster, fsdp_checkpoint, tmp_path):
    """A scheduler stops the merge (SIGTERM) while its tasks wait for a node: it stops, cancels its tasks,
    removes its staging folder and lock and exits non-zero (before: Ray's handler exited, leaving them)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_EVERY_MERGE_SLOT, cluster.address, "2"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    target = tmp_path / "out"
    try:
        assert holder.stdout.readline().strip() == "held"
        command = cli_merge_command(
            fsdp_checkpoint(FsdpSpec()).role_dir,
            target,
            "--ray-address",
            cluster.address,
            "--ray-resource",
            MERGE_RESOURCE,
        )
        merging = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        for line in merging.stderr:
            if line.startswith("Ray: 1 write tasks"):
                break
        assert staging_path(target).is_dir() and lock_path(target).exists()
        time.sleep(2)  # waiting in ray.wait
        merging.send_signal(signal.SIGTERM)
        started = time.monotonic()
        rest = merging.stderr.read()
        code = merging.wait(timeout=90)
        took = time.monotonic() - started
    finally:
        holder.communicate(timeout=60)

    assert code == 128 + signal.SIGTERM and took < 30, (code, took, rest)
    assert "terminated (SIGTERM): nothing was published" in rest
    assert_nothing_left(target)
