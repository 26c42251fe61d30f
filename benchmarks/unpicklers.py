"""One rank file read by our state-dict interpreter against torch's own weights-only unpickler.

    .venv/bin/python -m benchmarks.unpicklers [--size large] [--world-size 1024] [--files 64] [--repeat 5]

For ``--files`` rank files spread over the ``--size`` FSDP checkpoint saved at ``--world-size`` ranks
(``benchmarks.checkpoints``; made on first use), each read ``--repeat`` times in turn, one reader after
the other, in this process with a warm page cache:

- ``ours``: what the merge runs on a rank file it unpickles (``torch_files.load_meta_state_dict``: the
  zip located and cross-checked as torch's reader sees it, then ``state_dict_pickle``);
- ``ours, pickle only``: ``state_dict_pickle`` alone, on the archive already located;
- ``torch.load meta``: ``torch.load(f, map_location="meta", weights_only=True)``;
- ``torch.load mmap``: ``torch.load(f, map_location="cpu", weights_only=True, mmap=True)``.

Each file's time is its fastest of the repeats (the machine is shared); the table gives the median and
the slowest of those over the files, in milliseconds, and the CPU time the same way.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.checkpoints import DEFAULT_CACHE, ensure_world_size_checkpoint


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.unpicklers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="large")
    parser.add_argument("--world-size", type=int, default=1024)
    parser.add_argument("--files", type=int, default=64, help="rank files measured, spread over the ranks")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args(argv)

    import logging

    import torch

    from merge_pipeline.formats.torch_files import load_meta_state_dict, torch_archive

    # torch.load warns once per DeviceMesh that no process group exists (none is needed to read one)
    logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)
    torch.set_num_threads(1)  # as the merge's planning thread; the numbers are per file
    role_dir = ensure_world_size_checkpoint(args.size, args.world_size, args.cache_dir).role_dir
    step = max(1, args.world_size // args.files)
    paths = [role_dir / f"model_world_size_{args.world_size}_rank_{r}.pt" for r in range(0, args.world_size, step)]

    def pickle_only(path: Path) -> Callable[[], object]:
        with torch_archive(path) as archive:
            pass  # located and read (the pickle's bytes are kept); the stream is not needed to unpickle
        return archive.unpickle

    readers: dict[str, Callable[[Path], Callable[[], object]]] = {
        "ours (zip checks + interpreter)": lambda path: lambda: load_meta_state_dict(path),
        "ours, pickle only": pickle_only,
        'torch.load map_location="meta"': lambda path: lambda: torch.load(path, map_location="meta", weights_only=True),
        'torch.load mmap=True, map_location="cpu"': lambda path: (
            lambda: torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        ),
    }
    for path in paths[:2]:  # same answer: the same names, shapes and dtypes
        mine, theirs = load_meta_state_dict(path), torch.load(path, map_location="meta", weights_only=True)
        assert [(k, v.shape, v.dtype) for k, v in mine.items()] == [(k, v.shape, v.dtype) for k, v in theirs.items()]

    best: dict[str, list[tuple[float, float]]] = {name: [] for name in readers}
    for path in paths:
        calls = {name: make(path) for name, make in readers.items()}
        times = {name: [] for name in readers}
        for _ in range(args.repeat):
            for name, call in calls.items():  # interleaved: each reader meets the same moments of load
                wall, cpu = time.perf_counter(), time.process_time()
                call()
                times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
        for name, samples in times.items():
            best[name].append(min(samples))

    with open("/proc/loadavg") as load:
        print(
            f"{len(paths)} rank files of {role_dir} (best of {args.repeat} each); load average {load.read().split()[:3]}"
        )
    print("| reader | median ms | slowest file ms | median CPU ms |")
    print("|---|---:|---:|---:|")
    for name, samples in best.items():
        walls, cpus = [s[0] * 1e3 for s in samples], [s[1] * 1e3 for s in samples]
        print(f"| {name} | {statistics.median(walls):.1f} | {max(walls):.1f} | {statistics.median(cpus):.1f} |")


if __name__ == "__main__":
    main()
