"""A world-size checkpoint merged under torchrun by 1, 2 and 4 processes: what each process reads.

    .venv/bin/python -m benchmarks.torchrun_shares --size large --world-size 1024 --processes 1,2,4 \\
        [--max-shard-size 64MB] [--repeat 1]

Each merge is ``torchrun --standalone --nproc-per-node N -m benchmarks.torchrun_shares --rank-process ...``:
every rank process counts the bytes its ``os.pread``/``os.preadv`` calls return from the rank files
(``*.pt``) and writes them, with its own CPU time and peak RSS, to a JSON file when it exits. The
merge itself is ``python -m merge_pipeline merge`` unchanged. ``--max-shard-size`` cuts the output
into several files so that there is something to share (ranks write whole output files). Wall time
is torchrun's from spawn to exit; the counting costs a ``readlink`` per read.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import resource
import runpy
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.checkpoints import DEFAULT_CACHE, ensure_world_size_checkpoint
from benchmarks.measure import prepare_cache, remove, run_child


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.torchrun_shares", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="large")
    parser.add_argument("--world-size", type=int, default=1024)
    parser.add_argument("--processes", default="1,2,4")
    parser.add_argument("--max-shard-size", default="64MB")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--json", type=Path, help="write every sample here")
    args = parser.parse_args(argv)

    checkpoint = ensure_world_size_checkpoint(args.size, args.world_size, args.cache_dir)
    input_bytes = sum(p.stat().st_size for p in checkpoint.model_files)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    samples = []
    with tempfile.TemporaryDirectory(prefix="torchrun-shares-") as scratch:
        for repeat in range(args.repeat):
            for n in [int(p) for p in args.processes.split(",") if p.strip()]:
                target, reports = Path(scratch) / "out", Path(scratch) / f"reports-{repeat}-{n}"
                reports.mkdir()
                prepare_cache(checkpoint.model_files, "warm")
                command = [torchrun, "--standalone", f"--nproc-per-node={n}", "-m", "benchmarks.torchrun_shares"]
                command += ["--rank-process", str(reports), "merge", "--local_dir", str(checkpoint.role_dir)]
                command += ["--target_dir", str(target), "--dtype", "bfloat16", "--no-progress"]
                command += ["--max-shard-size", args.max_shard_size]
                run = run_child(command, cwd=Path(scratch)).check(f"torchrun merge with {n} processes")
                remove(target)
                ranks = sorted((json.loads(p.read_text()) for p in reports.iterdir()), key=lambda r: r["rank"])
                sample = {"processes": n, "wall_s": run.wall_s, "ranks": ranks}
                samples.append(sample)
                print(json.dumps(sample), flush=True)
    print(table(samples, input_bytes))
    if args.json:
        args.json.write_text(json.dumps(samples, indent=1))


def table(samples: list[dict], input_bytes: int) -> str:
    lines = [
        f"| processes | wall s | per process: rank-file bytes read (of {input_bytes / 1e6:.0f} MB), CPU s, peak RSS MB |",
        "|---:|---:|---|",
    ]
    for s in samples:
        ranks = "; ".join(
            f"rank {r['rank']}: {r['rank_file_bytes'] / 1e6:.0f} MB, {r['cpu_s']:.1f} s, {r['peak_rss_mb']:.0f} MB"
            for r in s["ranks"]
        )
        lines.append(f"| {s['processes']} | {s['wall_s']:.1f} | {ranks} |")
    return "\n".join(lines)


def rank_process(reports: Path, argv: list[str]) -> None:
    """Run ``python -m merge_pipeline *argv`` in this torchrun rank, counting the bytes read from rank files."""
    counted = {"bytes": 0}
    pread, preadv = os.pread, os.preadv

    def is_rank_file(fd: int) -> bool:
        return os.readlink(f"/proc/self/fd/{fd}").endswith(".pt")

    def counting_pread(fd, length, offset):
        data = pread(fd, length, offset)
        counted["bytes"] += len(data) if is_rank_file(fd) else 0
        return data

    def counting_preadv(fd, buffers, offset, *flags):
        n = preadv(fd, buffers, offset, *flags)
        counted["bytes"] += n if is_rank_file(fd) else 0
        return n

    os.pread, os.preadv = counting_pread, counting_preadv

    def report() -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        rank = int(os.environ.get("RANK", "0"))
        (reports / f"rank-{rank}.json").write_text(
            json.dumps(
                {
                    "rank": rank,
                    "rank_file_bytes": counted["bytes"],
                    "cpu_s": usage.ru_utime + usage.ru_stime,
                    "peak_rss_mb": usage.ru_maxrss / 1e3,
                    "ended": time.time(),
                }
            )
        )

    atexit.register(report)
    sys.argv = ["merge_pipeline", *argv]
    runpy.run_module("merge_pipeline", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--rank-process":
        rank_process(Path(sys.argv[2]), sys.argv[3:])
    else:
        main()
