"""What averaging K steps costs: ``merge-pipeline average`` of K checkpoints against K single merges
of the same checkpoints, and against the raw I/O floor (read the K inputs once, write one output).

    .venv/bin/python -m benchmarks.average --size medium --steps 3 --dtype bfloat16 --repeat 2 [--cache cold]

The K steps are FSDP2 checkpoints of one model written by torch's fake process group (seeds 0..K-1),
cached under ``--cache-dir``. Per repeat, in the same minutes of the machine: each single merge (a fresh
``python -m merge_pipeline merge`` child, page cache as ``--cache`` says), then the average of all K (a
fresh ``average`` child), then each step's reading alone, then the raw floor (the K inputs read and
one output written by plain system calls). Wall from spawn to exit, CPU seconds and peak RSS from
``wait4``. The table uses the fastest run of each.

The target is the average's wall against "K single merges' reading plus one write". A step's
reading R_k is timed in a child that plans the step as its merge does and drains every tensor source
(each piece copied out: the reads, the rank files' reassembly), writing nothing. A single merge's wall S less its reading is
its write and fixed costs, paid once by the average too: the target is ``S + sum(R_k) - R_last``,
with S the last step's merge.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.checkpoints import DEFAULT_CACHE, REPO_ROOT, SIZES
from benchmarks.measure import files_under, prepare_cache, raw_copy, remove, run_child, weight_bytes

MiB = 2**20


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.average", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="medium", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=3, help="K: checkpoints averaged (default 3)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", help="--dtype of the merges and the average")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--cache", choices=("warm", "cold", "drop"), default="warm")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--read-only", type=Path, help=argparse.SUPPRESS)  # internal: one step's reading
    args = parser.parse_args(argv)
    if args.read_only:
        return _read_only(args.read_only, args.dtype)

    load_before = Path("/proc/loadavg").read_text().split()[:3]
    steps = [_step(args.cache_dir, args.size, args.world_size, seed) for seed in range(args.steps)]
    inputs = files_under(steps)
    flags = ["--no-progress", "--dtype", args.dtype]
    best: dict[str, list] = {}
    with tempfile.TemporaryDirectory(dir=args.cache_dir) as scratch:
        out = Path(scratch)
        for _ in range(args.repeat):
            singles = []
            for index, step in enumerate(steps):
                prepare_cache(inputs, args.cache)
                target = out / f"single_{index}"
                command = ["merge", "--local_dir", str(step), "--target_dir", str(target)]
                singles.append(_cli(command + flags))
                written = weight_bytes(target)
                remove(target)
            prepare_cache(inputs, args.cache)
            target = out / "average"
            averaged = _cli(["average", "--inputs", *map(str, steps), "--target_dir", str(target), *flags])
            remove(target)
            prepare_cache(inputs, args.cache)
            floor = raw_copy(inputs, out / "raw", written)
            remove(out / "raw")
            reads = []
            for step in steps:
                prepare_cache(inputs, args.cache)
                reads.append(float(_cli_read(step, args.dtype).output.split()[-1]))
            run = {
                "singles_wall_s": sum(r.wall_s for r in singles),
                "singles_cpu_s": sum(r.cpu_s for r in singles),
                "single_peak_rss_mib": max(r.peak_rss_bytes for r in singles) / MiB,
                "average_wall_s": averaged.wall_s,
                "average_cpu_s": averaged.cpu_s,
                "average_peak_rss_mib": averaged.peak_rss_bytes / MiB,
                "raw_floor_s": floor,
                "last_single_wall_s": singles[-1].wall_s,
                "reading_s": sum(reads),
                "last_reading_s": reads[-1],
            }
            for key, value in run.items():
                best.setdefault(key, []).append(value)
    fastest = {key: min(values) if not key.endswith("rss_mib") else max(values) for key, values in best.items()}
    input_mib = sum(p.stat().st_size for p in inputs) / MiB
    k = args.steps
    target = fastest["last_single_wall_s"] + fastest["reading_s"] - fastest["last_reading_s"]
    print(
        f"{args.steps} steps of {args.size} ({input_mib:.0f} MiB of rank files), --dtype {args.dtype}, {args.cache} cache"
    )
    print("| | wall s | CPU s | peak RSS MiB |")
    print("|---|---:|---:|---:|")
    print(
        f"| {args.steps} single merges | {fastest['singles_wall_s']:.1f} | {fastest['singles_cpu_s']:.1f} | {fastest['single_peak_rss_mib']:.0f} |"
    )
    print(
        f"| average of {args.steps} | {fastest['average_wall_s']:.1f} | {fastest['average_cpu_s']:.1f} | {fastest['average_peak_rss_mib']:.0f} |"
    )
    print(f"| raw floor: read {k} inputs, write one output | {fastest['raw_floor_s']:.1f} | | |")
    print(f"| reading alone: {k} steps planned and drained, nothing written | {fastest['reading_s']:.1f} | | |")
    print(
        f"average / {args.steps} single merges: wall {fastest['average_wall_s'] / fastest['singles_wall_s']:.2f}x, CPU {fastest['average_cpu_s'] / fastest['singles_cpu_s']:.2f}x"
    )
    print(
        f"target: {k} merges' reading plus one write = {target:.1f} s;"
        f" average / target = {fastest['average_wall_s'] / target:.2f}x (target: <= 1.2x)"
    )
    load_after = Path("/proc/loadavg").read_text().split()[:3]
    print(f"load average before {' '.join(load_before)}, after {' '.join(load_after)}")
    print(json.dumps({"runs": best}))


def _cli(arguments: list[str]):
    return run_child([sys.executable, "-m", "merge_pipeline", *arguments], cwd=REPO_ROOT).check(arguments[0])


def _cli_read(step: Path, dtype: str):
    """A child that plans ``step`` as its merge would and reads every tensor, writing nothing; prints the seconds."""
    return run_child(
        [sys.executable, "-m", "benchmarks.average", "--read-only", str(step), "--dtype", dtype], cwd=REPO_ROOT
    ).check("read")


def _read_only(step: Path, dtype: str) -> None:
    import torch

    import merge_pipeline.hf.architecture  # noqa: F401  transformers: a one-time import, not reading
    from merge_pipeline.options import MergeOptions
    from merge_pipeline.pipeline.prepare import prepare

    started = time.perf_counter()
    with prepare(step, MergeOptions(dtype=dtype)) as prepared:
        for tensor in prepared.outputs.planned_tensors:
            for piece in tensor.source.pieces():
                torch.empty_like(piece).copy_(piece)  # the bytes themselves: a piece may be a mapped view
    print(f"{time.perf_counter() - started:.3f}")


def _step(cache_dir: Path, size: str, world_size: int, seed: int) -> Path:
    """The role folder of step ``seed + 1`` (seed ``seed``), written once."""
    role_dir = cache_dir / f"average-{size}-ws{world_size}" / f"global_step_{seed + 1}" / "actor"
    done = role_dir.parent / "written"
    if not done.exists():
        remove(role_dir)
        spec = SIZES[size]
        command = [sys.executable, "-m", "merge_pipeline_samples.fsdp_fake_pg", str(role_dir)]
        command += ["--world-size", str(world_size), "--arch", "llama", "--seed", str(seed)]
        command += [f"--{key.replace('_', '-')}={value}" for key, value in spec.items()]
        subprocess.run(command, check=True, cwd=REPO_ROOT)
        done.touch()
    return role_dir


if __name__ == "__main__":
    main()
