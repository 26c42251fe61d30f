"""A real multi-node Ray cluster on this machine, for the Ray launcher's tests and benchmarks.

A head that runs no task (the driver connects to it) and worker nodes of one CPU each, every one its
own raylet (``ray.cluster_utils.Cluster``), each offering one unit of ``merge`` so that tasks asking
for it land one per node. Small object stores: the tasks pass reports, not tensors.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

from ray.cluster_utils import Cluster
from ray.util.state import list_tasks

OBJECT_STORE_BYTES = 80 << 20
MERGE_RESOURCE = "merge"
WRITE_TASK = "_write_task"  # workers.ray_tasks' task function, as Ray's task records name it


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def add_worker(cluster: Cluster, **resources: float):
    return cluster.add_node(
        num_cpus=1, object_store_memory=OBJECT_STORE_BYTES, resources={MERGE_RESOURCE: 1, **resources}
    )


@contextlib.contextmanager
def local_cluster(workers: int = 2) -> Iterator[Cluster]:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "object_store_memory": OBJECT_STORE_BYTES,
            "include_dashboard": True,  # its state API answers the tests' list_tasks
            "dashboard_port": free_port(),  # not 8265: another test session's cluster may hold it
        },
    )
    try:
        for _ in range(workers):
            add_worker(cluster)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


def write_tasks(cluster: Cluster, *, settled: bool = True, timeout: float = 60) -> list:
    """Ray's own records of the write tasks (every attempt), from its state API; ``settled``: once none
    is still running (the records follow the tasks by a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        tasks = list_tasks(address=cluster.address, filters=[("func_or_class_name", "=", WRITE_TASK)], limit=10_000)
        if not settled or all(t.state in ("FINISHED", "FAILED") for t in tasks) or time.monotonic() > deadline:
            return tasks
        time.sleep(0.5)
