"""A tiny run of the benchmark (benchmarks/run.py) so that it cannot rot; the full run stays out of CI.

It benchmarks the session's small FSDP fixture (world size 2) once, without verl, and checks that
the table is there and its numbers are sane.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from merge_pipeline_samples.fsdp import FsdpSpec

REPO_ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30


@pytest.fixture(scope="module")
def bench(fsdp_checkpoint, tmp_path_factory):
    sample = fsdp_checkpoint(FsdpSpec())  # the default spec: shared with the merge tests
    out = tmp_path_factory.mktemp("bench")
    command = [
        sys.executable,
        "-m",
        "benchmarks.run",
        "--checkpoint",
        str(sample.role_dir),
        "--repeat",
        "1",
        "--out",
        str(out),
        "--no-plot",
    ]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text()), (out / "results.md").read_text(), done.stdout


def test_benchmark_writes_a_table_with_sane_numbers(bench):
    out, results, markdown, stdout = bench
    assert not (out / "scratch").exists()  # merge outputs are cleaned up

    (checkpoint,) = results["checkpoints"]
    assert checkpoint["files"] == 2 and checkpoint["input_bytes"] > 0
    assert checkpoint["parameters"] > 10_000  # read back from our merge_manifest.json

    torch_only = results["interpreters"]["torch"]
    assert 50 * 2**20 < torch_only["peak_rss_bytes"][0] < 2 * GiB
    assert 0 < torch_only["wall_s"][0] < 120

    by_dtype = {s["dtype"]: s for s in results["runs"] if s["tool"] == "merge_pipeline"}
    raw = {s["dtype"]: s for s in results["runs"] if s["tool"] == "raw"}
    assert set(by_dtype) == set(raw) == {"float32", "bfloat16"}
    assert by_dtype["float32"]["output_bytes"] > by_dtype["bfloat16"]["output_bytes"] > 0  # bf16 halves the weights
    for dtype, series in by_dtype.items():
        (wall,), (rss,), (cpu,) = series["wall_s"], series["peak_rss_bytes"], series["cpu_s"]
        assert 0 < wall < 300 and 0 < cpu < 300, dtype
        # at least the interpreter's floor, and far from a model-sized figure for a tiny model
        assert torch_only["peak_rss_bytes"][0] * 0.8 < rss < torch_only["peak_rss_bytes"][0] + 1 * GiB, dtype
        (raw_s,) = raw[dtype]["wall_s"]
        assert 0 < raw_s < wall, dtype  # the raw copy has no start-up

    assert (
        "| size | params |" in markdown and "merge_pipeline | fp32" in markdown and "merge_pipeline | bf16" in markdown
    )
    assert "Targets:" in markdown and "run with --with-verl" in markdown
    assert markdown in stdout


def test_benchmark_plot_renders(bench, tmp_path):
    out, *_ = bench
    png = tmp_path / "plot.png"
    command = [sys.executable, "-m", "benchmarks.report", str(out / "results.json"), "--plot", str(png)]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_the_launcher_benchmark_measures_in_process_and_ray_on_two_nodes(tmp_path):
    """benchmarks/launchers.py once on the tiny FSDP checkpoint: its local Ray cluster, the figures it reads
    from the merge's own log lines (bytes read per node, each task's peak RSS and CPU), the table."""
    command = [sys.executable, "-m", "benchmarks.launchers", "--sizes", "tiny", "--repeat", "1"]
    command += ["--launchers", "in-process,ray", "--nodes", "2", "--max-shard-size", "200KB"]
    command += ["--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "out")]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "launchers.json").read_text())
    assert not (tmp_path / "out" / "launchers-scratch").exists()

    in_process, ray = results["cases"]
    assert (in_process["launcher"], ray["launcher"]) == ("in process", "Ray 2")
    assert 0 < in_process["wall_s"] < 600 and in_process["cpu_s"] > 0
    total = results["input_bytes"]["tiny"]
    tasks = ray["tasks"]
    assert len(tasks) == 2 and len({t["node"] for t in tasks}) == 2, "one task on each of two nodes"
    assert all(0 < t["read"] <= 1.05 * total for t in tasks)
    assert sum(t["read"] for t in tasks) >= 0.9 * total  # together they read the whole checkpoint
    assert all(50 * 2**20 < t["peak_rss_bytes"] < 2 * GiB and t["cpu_s"] > 0 for t in tasks)
    assert ray["cpu_s"] > ray["driver_cpu_s"] + sum(t["cpu_s"] for t in tasks) - 0.01
    (launch,) = results["launch"]
    assert all(launch[k] > 0 for k in ("import_s", "connect_s", "first_task_s", "torch_task_s"))
    assert "| tiny bfloat16 | Ray 2 |" in (tmp_path / "out" / "launchers.md").read_text()
