"""A resumed merge against an uninterrupted one: what a kill at ~80 % of the bytes costs.

    .venv/bin/python -m benchmarks.resume --size 1.1b --world-size 2 --max-shard-size 500MB --repeat 3 \\
        [--compare-with /path/to/other/checkout]
    .venv/bin/python -m benchmarks.resume --size 8b --world-size 8 --dtype bfloat16 --max-shard-size 1GB \\
        --cache cold --repeat 2     # larger than memory: 32 GB of rank files, ~65 GB of disk in all

Per repeat, in the same minutes of the machine: the uninterrupted merge (a fresh
``python -m merge_pipeline merge`` child, page cache as ``--cache`` says, wall from spawn to exit); the same
command killed with SIGKILL once its staging folder holds ``--kill-at`` of the weight bytes the
uninterrupted merge wrote; and the same command again, which resumes from that staging folder.
The resumed output's weight files are compared byte for byte with the uninterrupted ones. With
``--compare-with``, the same three runs with that checkout first on PYTHONPATH (e.g. main before a
change) follow each repeat's. The table uses the fastest run of each.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.checkpoints import DEFAULT_CACHE, REPO_ROOT, ensure_world_size_checkpoint
from benchmarks.measure import prepare_cache, remove, run_child, weight_bytes

_POLL_S = 0.01


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.resume", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="large")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--dtype", default="auto", help="--dtype of the merge (default auto: fp32 stays fp32)")
    parser.add_argument("--max-shard-size", default="100MB", help="so that the output has several files")
    parser.add_argument("--kill-at", type=float, default=0.8, help="fraction of the weight bytes written at the kill")
    parser.add_argument(
        "--cache",
        choices=("warm", "cold", "drop"),
        default="warm",
        help="page cache before each run: warm (read the rank files first), cold (evict them), drop (all; root)",
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--compare-with", type=Path, help="another checkout of merge_pipeline, measured alongside")
    args = parser.parse_args(argv)

    checkpoint = ensure_world_size_checkpoint(args.size, args.world_size, args.cache_dir)
    versions = {"this checkout": REPO_ROOT}
    if args.compare_with:
        versions = {str(args.compare_with): args.compare_with.resolve(), **versions}
    samples = {
        v: {"uninterrupted": [], "killed": [], "resumed": [], "uninterrupted_cpu": [], "resumed_cpu": []}
        for v in versions
    }
    with tempfile.TemporaryDirectory(prefix="resume-bench-", dir=os.environ.get("BENCH_SCRATCH")) as scratch:
        scratch = Path(scratch)
        command = [sys.executable, "-m", "merge_pipeline", "merge", "--local_dir", str(checkpoint.role_dir)]
        command += ["--dtype", args.dtype, "--max-shard-size", args.max_shard_size, "--no-progress"]
        for repeat in range(args.repeat):
            for version, root in versions.items():
                env = {**os.environ, "PYTHONPATH": str(root)}
                runs = samples[version]
                whole, resumed = scratch / "whole", scratch / "resumed"
                prepare_cache(checkpoint.model_files, args.cache)
                run = run_child(command + ["--target_dir", str(whole)], cwd=scratch, env=env)
                runs["uninterrupted"].append(run.check("uninterrupted merge").wall_s)
                runs["uninterrupted_cpu"].append(run.cpu_s)
                total = weight_bytes(whole)

                prepare_cache(checkpoint.model_files, args.cache)
                killed_after, written = kill_at(
                    command + ["--target_dir", str(resumed)], scratch, env, total * args.kill_at
                )
                runs["killed"].append(killed_after)
                prepare_cache(checkpoint.model_files, args.cache)
                run = run_child(command + ["--target_dir", str(resumed)], cwd=scratch, env=env).check("resumed merge")
                runs["resumed"].append(run.wall_s)
                runs["resumed_cpu"].append(run.cpu_s)
                identical = same_weights(whole, resumed)
                print(
                    f"repeat {repeat + 1}, {version}: uninterrupted {runs['uninterrupted'][-1]:.2f} s; killed after "
                    f"{killed_after:.2f} s at {written / total:.0%} of {total / 1e9:.2f} GB; resumed {run.wall_s:.2f} s "
                    f"({run.wall_s / runs['uninterrupted'][-1]:.2f}x); bit-identical: {identical}",
                    flush=True,
                )
                if not identical:
                    raise SystemExit("the resumed merge's weight files differ from the uninterrupted merge's")
                remove(whole)
                remove(resumed)
    print("| code | case | uninterrupted s | resumed s | resumed / uninterrupted | CPU s: uninterrupted, resumed |")
    print("|---|---|---:|---:|---:|---|")
    for version, runs in samples.items():
        best = {k: min(v) for k, v in runs.items()}
        print(
            f"| {version} | {checkpoint.name} {args.dtype}, {args.cache} cache, shards <= {args.max_shard_size}, "
            f"killed at {args.kill_at:.0%} | "
            f"{best['uninterrupted']:.2f} | {best['resumed']:.2f} | {best['resumed'] / best['uninterrupted']:.2f}x | "
            f"{best['uninterrupted_cpu']:.1f}, {best['resumed_cpu']:.1f} |"
        )
    print(json.dumps(samples))


def kill_at(command: list[str], cwd: Path, env: dict, threshold: float) -> tuple[float, int]:
    """Start ``command``; SIGKILL it once its staging folder holds ``threshold`` bytes. Seconds and bytes at the kill."""
    target = Path(command[command.index("--target_dir") + 1])
    staging = target.parent / f".{target.name}.staging"  # engine.publish.staging_path, without importing the package
    started = time.perf_counter()
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    written = 0
    while process.poll() is None:
        written = weight_bytes(staging) if staging.is_dir() else 0
        if written >= threshold:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return time.perf_counter() - started, written
        time.sleep(_POLL_S)
    raise SystemExit(f"the merge to be killed finished first (exit {process.returncode}): lower --kill-at")


def same_weights(a: Path, b: Path) -> bool:
    names = sorted(p.relative_to(a) for p in a.rglob("*.safetensors"))
    if names != sorted(p.relative_to(b) for p in b.rglob("*.safetensors")):
        return False
    return all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)


if __name__ == "__main__":
    main()
