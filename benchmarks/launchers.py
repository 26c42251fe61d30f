"""The launcher axis: one merge in process, under torchrun, and on a local Ray cluster of 1, 2 and 3 nodes.

    .venv/bin/python -m benchmarks.launchers                        # 248M and 1.1B, bf16, 3 repeats
    .venv/bin/python -m benchmarks.launchers --sizes large --repeat 1 --nodes 2
    .venv/bin/python -m benchmarks.launchers --sizes 1.1b --launchers in-process,in-process-1-thread,ray --nodes 2

Per size, interleaved, ``--repeat`` times, each from a cold cache (the rank files evicted, as in
benchmarks/run.py) and in a fresh child process (``measure.run_child``: wall from spawn to exit, CPU
and ``ru_maxrss`` from ``wait4``):

* ``in process``: ``python -m merge_pipeline merge``; ``in process, OMP_NUM_THREADS=1``: the same with torch
  on one thread, as torchrun and Ray start their workers (on a loaded machine torch's second thread
  waits for a core at every cast: see docs/BENCHMARKS.md);
* ``torchrun x2``: ``torchrun --standalone --nproc-per-node 2`` of the same merge; each rank counts the
  rank-file bytes it reads and reports its CPU and peak RSS (``benchmarks.torchrun_shares``);
* ``Ray, N nodes``: ``merge --ray-address`` as a driver on a local cluster (a head with no CPU, three
  worker raylets of one CPU each on 127.0.0.1, ``ray.cluster_utils.Cluster`` in a child process, started
  once and kept for every run). Node k offers the custom resources ``n{k}`` ... ``n3``, so
  ``--ray-resource nN`` puts the N tasks on N nodes; the other raylets idle. Bytes read per node, each
  task's peak RSS and CPU come from the merge's own log lines; the CPU of all processes is the driver's
  (``wait4``), plus the tasks' (each a fresh worker process: its own ``getrusage``, in its log line),
  plus what the cluster's daemons (GCS, raylets, dashboard) spent meanwhile (their process tree's CPU,
  read by the cluster's child; task workers that exited are not in it: the raylets reap them without
  adding up their CPU).

The launch overhead is measured apart, per repeat: a fresh process imports Ray, connects as the merge
does (``workers.ray_tasks._connect``: the driver's package shipped as a ``py_modules`` runtime env), runs an
empty task in a fresh worker, then one that imports torch and the merge's modules.

All outputs are cut at ``--max-shard-size`` (200MB) so that there are files to share out. Writes
``launchers.json`` (every sample) and ``launchers.md`` (the tables) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.checkpoints import DEFAULT_CACHE, REPO_ROOT, ensure_checkpoint
from benchmarks.measure import prepare_cache, remove, run_child

NODES = 3  # worker raylets of the local cluster
LAUNCHERS = {
    "in-process": "in process",
    # torchrun and Ray start their workers with OMP_NUM_THREADS=1: torch casts on one thread there
    "in-process-1-thread": "in process, OMP_NUM_THREADS=1",
    "torchrun": "torchrun x2",
    "ray": "Ray",
}
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_BYTES = r"([\d.]+ (?:B|KiB|MiB|GiB|TiB))"
TASK_LINE = re.compile(
    rf"Ray task \d+/\d+ on (\S+ \(\w+\)) wrote \d+ weight file\(s\), {_BYTES}, reading {_BYTES} \(peak RSS {_BYTES}, CPU ([\d.]+) s\)"
)

HOLD_CLUSTER = """
import json, sys
import psutil
from local_servers.ray_cluster import add_worker, local_cluster

def tree_cpu():
    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total

nodes = int(sys.argv[1])
with local_cluster(workers=0) as cluster:
    for k in range(1, nodes + 1):  # node k offers n{k}..n{nodes}: the resource nN is on exactly N nodes
        add_worker(cluster, **{f"n{j}": 1 for j in range(k, nodes + 1)})
    cluster.wait_for_nodes()
    print(json.dumps({"address": cluster.address}), flush=True)
    for line in sys.stdin:  # each line asks for the cluster's CPU so far
        print(json.dumps({"cpu_s": tree_cpu()}), flush=True)
"""

LAUNCH_OVERHEAD = """
import json, sys, time
started = time.perf_counter()
import ray
from merge_pipeline.workers.ray_tasks import _connect
imported = time.perf_counter()
_connect(ray, sys.argv[1])
connected = time.perf_counter()

@ray.remote(max_calls=1, num_cpus=1, resources={"n1": 1})
def empty():
    return None

@ray.remote(max_calls=1, num_cpus=1, resources={"n1": 1})
def with_torch():
    import torch, merge_pipeline.pipeline.merge, merge_pipeline.formats.fsdp.reader
    return None

ray.get(empty.remote())
first = time.perf_counter()
ray.get(with_torch.remote())
torch_task = time.perf_counter()
print(json.dumps({"import_s": imported - started, "connect_s": connected - imported,
                  "first_task_s": first - connected, "torch_task_s": torch_task - first}))
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.launchers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="large,1.1b", help="FSDP sizes of benchmarks/checkpoints.py")
    parser.add_argument("--dtypes", default="bfloat16", help="--dtype values to merge with (default bfloat16)")
    parser.add_argument("--nodes", default="1,2,3", help=f"Ray node counts, each at most {NODES}")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--max-shard-size", default="200MB")
    parser.add_argument(
        "--launchers",
        default=",".join(LAUNCHERS),
        help=f"comma-separated, from {', '.join(LAUNCHERS)} (default: all; ray runs once per --nodes)",
    )
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds allowed per child process")
    args = parser.parse_args(argv)
    args.node_counts = [int(n) for n in args.nodes.split(",") if n.strip()]
    args.chosen = [name.strip() for name in args.launchers.split(",") if name.strip()]
    if not args.chosen or not set(args.chosen) <= set(LAUNCHERS):
        parser.error(f"--launchers: choose from {', '.join(LAUNCHERS)}")
    if not all(1 <= n <= NODES for n in args.node_counts):
        parser.error(f"--nodes: each from 1 to {NODES}")
    return args


def log(message: str) -> None:
    print(f"[launchers {time.strftime('%H:%M:%S')}] {message}", flush=True)


class LocalCluster:
    """The Ray cluster, in a child process (the runner stays small: a child's ru_maxrss starts from it)."""

    def __init__(self, nodes: int):
        self.process = subprocess.Popen(
            [sys.executable, "-c", HOLD_CLUSTER, str(nodes)],
            cwd=REPO_ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.address = self._answer()["address"]

    def _answer(self) -> dict:
        for line in self.process.stdout:
            if line.startswith("{"):  # Ray may print its own lines
                return json.loads(line)
        raise SystemExit(f"the local Ray cluster did not start (exit {self.process.wait()})")

    def cpu_s(self) -> float:
        """CPU seconds spent so far by the cluster's running processes (the daemons)."""
        self.process.stdin.write("cpu\n")
        self.process.stdin.flush()
        return self._answer()["cpu_s"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=120)


def merge_command(role_dir: Path, target: Path, dtype: str, shard: str) -> list[str]:
    return ["merge", "--local_dir", str(role_dir), "--target_dir", str(target), "--dtype", dtype, "--no-progress"] + [
        "--max-shard-size",
        shard,
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    scratch = out / "launchers-scratch"
    remove(scratch)
    scratch.mkdir()
    checkpoints = [ensure_checkpoint(s.strip(), args.cache_dir, log=log) for s in args.sizes.split(",") if s.strip()]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    results = {"settings": vars(args) | {"cache_dir": str(args.cache_dir), "out": str(out)}, "cases": [], "launch": []}
    results["settings"].pop("node_counts")
    log(f"starting a local Ray cluster: a head and {NODES} worker nodes")
    cluster = LocalCluster(NODES)
    try:
        for repeat in range(args.repeat):
            results["launch"].append(launch_overhead(cluster, scratch, args.timeout))
            log(f"launch overhead #{repeat + 1}: {results['launch'][-1]}")
            for checkpoint in checkpoints:
                for dtype in dtypes:
                    for launcher in launchers(args):
                        sample = measure(checkpoint, dtype, launcher, cluster, scratch, args)
                        results["cases"].append(sample)
                        log(
                            f"{checkpoint.name} {dtype} {launcher} #{repeat + 1}: {sample['wall_s']:.2f} s, "
                            f"CPU {sample['cpu_s']:.1f} s, load {sample['load'][0]:.1f}"
                        )
    finally:
        cluster.close()
        remove(scratch)
    for checkpoint in checkpoints:
        results.setdefault("input_bytes", {})[checkpoint.name] = checkpoint.input_bytes
    (out / "launchers.json").write_text(json.dumps(results, indent=1) + "\n")
    markdown = render(results)
    (out / "launchers.md").write_text(markdown)
    print(markdown)
    return 0


def launchers(args) -> list[str]:
    return [
        name
        for chosen in args.chosen
        for name in ([f"Ray {n}" for n in args.node_counts] if chosen == "ray" else [LAUNCHERS[chosen]])
    ]


def launch_overhead(cluster: LocalCluster, scratch: Path, timeout: float) -> dict:
    run = run_child([sys.executable, "-c", LAUNCH_OVERHEAD, cluster.address], cwd=scratch, timeout=timeout)
    run.check("the launch-overhead probe")
    return json.loads(run.output.strip().splitlines()[-1]) | {"load": os.getloadavg()}


def measure(checkpoint, dtype: str, launcher: str, cluster: LocalCluster, scratch: Path, args) -> dict:
    target, reports = scratch / "out", scratch / "rank-reports"
    remove(reports)
    reports.mkdir()
    merge = merge_command(checkpoint.role_dir, target, dtype, args.max_shard_size)
    env = None
    if launcher.startswith("in process"):
        command = [sys.executable, "-m", "merge_pipeline", *merge]
        if launcher == LAUNCHERS["in-process-1-thread"]:  # torch's threads as torchrun and Ray set them
            env = os.environ | {"OMP_NUM_THREADS": "1"}
    elif launcher == "torchrun x2":
        torchrun = str(Path(sys.executable).parent / "torchrun")
        command = [torchrun, "--standalone", "--nproc-per-node=2", "-m", "benchmarks.torchrun_shares"]
        command += ["--rank-process", str(reports), *merge]
    else:
        nodes = int(launcher.split()[1])
        command = [sys.executable, "-m", "merge_pipeline", *merge, "--ray-address", cluster.address]
        command += ["--ray-resource", f"n{nodes}"]
    prepare_cache(checkpoint.model_files, "cold")
    load = os.getloadavg()
    cluster_before = cluster.cpu_s()
    run = run_child(command, cwd=scratch, env=env, timeout=args.timeout).check(f"{launcher} merge of {checkpoint.name}")
    cluster_cpu = cluster.cpu_s() - cluster_before
    remove(target)
    sample = {"size": checkpoint.name, "dtype": dtype, "launcher": launcher, "wall_s": run.wall_s, "load": load}
    if launcher.startswith("Ray"):
        tasks = [
            {
                "node": m[1],
                "written": to_bytes(m[2]),
                "read": to_bytes(m[3]),
                "peak_rss_bytes": to_bytes(m[4]),
                "cpu_s": float(m[5]),
            }
            for m in TASK_LINE.finditer(run.output)
        ]
        if len(tasks) != int(launcher.split()[1]):
            raise RuntimeError(f"{launcher}: expected one log line per task:\n{run.output}")
        tasks_cpu = sum(t["cpu_s"] for t in tasks)
        sample |= {"driver_cpu_s": run.cpu_s, "driver_peak_rss_bytes": run.peak_rss_bytes, "tasks": tasks}
        sample |= {"daemons_cpu_s": cluster_cpu, "cpu_s": run.cpu_s + tasks_cpu + cluster_cpu}
    elif launcher == "torchrun x2":
        ranks = sorted((json.loads(p.read_text()) for p in reports.iterdir()), key=lambda r: r["rank"])
        tasks = [
            {
                "node": f"rank {r['rank']}",
                "read": r["rank_file_bytes"],
                "peak_rss_bytes": int(r["peak_rss_mb"] * 1e6),
                "cpu_s": r["cpu_s"],
            }
            for r in ranks
        ]
        sample |= {"cpu_s": run.cpu_s, "tasks": tasks}
    else:
        sample |= {"cpu_s": run.cpu_s, "tasks": [{"node": "this", "peak_rss_bytes": run.peak_rss_bytes}]}
    return sample


def to_bytes(text: str) -> int:
    number, unit = text.split()
    return round(float(number) * UNITS[unit])


def render(results: dict) -> str:
    lines = [
        "| case | launcher | wall s: fastest (median) | x in process | CPU s, all processes | rank-file bytes read per node (share) | peak RSS per task MB | load (1 min) of the fastest |",
        "|---|---|---:|---:|---:|---|---|---:|",
    ]
    groups: dict[tuple, list[dict]] = {}
    for s in results["cases"]:
        groups.setdefault((s["size"], s["dtype"], s["launcher"]), []).append(s)
    for (size, dtype, launcher), samples in groups.items():
        fastest = min(samples, key=lambda s: s["wall_s"])
        base = groups.get((size, dtype, "in process"))  # not measured: no ratio
        ratio = f"{fastest['wall_s'] / min(s['wall_s'] for s in base):.2f}" if base else "-"
        total = results["input_bytes"][size]
        reads = (
            "; ".join(
                f"{_node(t['node'])} {t['read'] / 1e6:.0f} MB ({100 * t['read'] / total:.0f} %)"
                for t in _by_node(fastest["tasks"])
            )
            if "read" in fastest["tasks"][0]
            else f"all {total / 1e6:.0f} MB"
        )
        rss = ", ".join(f"{t['peak_rss_bytes'] / 1e6:.0f}" for t in fastest["tasks"])
        if "driver_peak_rss_bytes" in fastest:
            rss += f" (driver {fastest['driver_peak_rss_bytes'] / 1e6:.0f})"
        median = statistics.median(s["wall_s"] for s in samples)
        lines.append(
            f"| {size} {dtype} | {launcher} | {fastest['wall_s']:.2f} ({median:.2f}) | {ratio} |"
            f" {fastest['cpu_s']:.1f} | {reads} | {rss} | {fastest['load'][0]:.1f} |"
        )
    lines += [
        "",
        "| launch overhead, s (fastest of each) | import Ray and merge_pipeline.workers.ray_tasks (torch) | connect (package shipped) | first empty task | first task importing torch | load |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    launch = results["launch"]
    if launch:
        loads = ", ".join(f"{p['load'][0]:.1f}" for p in launch)
        lines.append(
            "| fresh driver, cluster already running | "
            + " | ".join(f"{min(p[k] for p in launch):.2f}" for k in ("import_s", "connect_s", "first_task_s"))
            + f" | {min(p['torch_task_s'] for p in launch):.2f} | {loads} |"
        )
    return "\n".join(lines) + "\n"


def _by_node(tasks: list[dict]) -> list[dict]:
    nodes: dict[str, dict] = {}
    for t in tasks:
        nodes.setdefault(t["node"], {"node": t["node"], "read": 0})["read"] += t["read"]
    return list(nodes.values())


def _node(name: str) -> str:
    return name.split("(")[-1].rstrip(")") if "(" in name else name


if __name__ == "__main__":
    sys.exit(main())
