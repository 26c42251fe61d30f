"""Time and peak memory of reading a ~250M-parameter Megatron checkpoint written with TP=2.

    python benchmarks/megatron_probe.py [--root DIR]

Writes the checkpoint with megatron-core (two ranks, CPU; a few minutes and ~2 GB of disk), then,
each in a fresh process so peak RSS is its own: (1) ``plan_megatron`` plus materialising every
tensor through its source's ``pieces()``; (2) the full CLI merge. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANT = dict(name="llama_250m_tp2", family="llama", tp=2, size="250m")


def _peak_rss_mib() -> float:
    # VmHWM is this process's own high-water mark. ru_maxrss is not: Linux carries the parent's
    # peak across fork + exec into it, and the parent here held the whole model.
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def measure_plan(role_dir: Path) -> dict:
    from merge_pipeline.formats.megatron.reader import plan_megatron
    from merge_pipeline.hf.config import CheckpointConfig
    from merge_pipeline.plan import StoredBytes

    baseline = _peak_rss_mib()
    started = time.monotonic()
    plan = plan_megatron(role_dir, CheckpointConfig(role_dir), is_value_model=None, tie_word_embedding=None)
    planned = time.monotonic()
    largest_piece = 0
    with plan:
        for tensor in plan.tensors:
            for piece in tensor.source.pieces():
                largest_piece = max(largest_piece, piece.numel() * piece.element_size())
    return {
        "plan_seconds": round(planned - started, 3),
        "materialize_seconds": round(time.monotonic() - planned, 2),
        "tensors": len(plan.tensors),
        "byte_copy_tensors": sum(isinstance(t.source, StoredBytes) for t in plan.tensors),
        "parameters": plan.parameter_count,
        "largest_output_tensor_mib": round(max(t.nbytes() for t in plan.tensors) / 2**20, 1),
        "largest_piece_mib": round(largest_piece / 2**20, 1),
        "rss_after_imports_mib": round(baseline),
        "peak_rss_mib": round(_peak_rss_mib()),
    }


def measure_merge(role_dir: Path, target: Path) -> dict:
    from merge_pipeline.cli import main

    baseline = _peak_rss_mib()
    started = time.monotonic()
    code = main(
        ["merge", "--backend", "megatron", "--local_dir", str(role_dir), "--target_dir", str(target), "--no-progress"]
    )
    return {
        "exit": code,
        "merge_seconds": round(time.monotonic() - started, 2),
        "rss_after_imports_mib": round(baseline),
        "peak_rss_mib": round(_peak_rss_mib()),
    }


def _in_child(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.megatron_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, help="where to write the checkpoint (default: a temporary folder)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *paths = args.child
        result = measure_plan(Path(paths[0])) if kind == "plan" else measure_merge(Path(paths[0]), Path(paths[1]))
        print(json.dumps(result))
        return
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    from merge_pipeline_samples.megatron import Variant, write_megatron_samples

    root = args.root or Path(tempfile.mkdtemp(prefix="megatron_probe_"))
    started = time.monotonic()
    sample = write_megatron_samples(root, [Variant(**VARIANT)], timeout=1800)[VARIANT["name"]]
    written = time.monotonic() - started
    metadata = FileSystemReader(str(sample.role_dir / "dist_ckpt")).read_metadata()
    stacked = max(
        (m for k, m in metadata.state_dict_metadata.items() if hasattr(m, "size") and "decoder.layers." in k),
        key=lambda m: math.prod(m.size),
    )
    report = {
        "checkpoint": str(sample.role_dir),
        "write_seconds": round(written, 1),
        "largest_stacked_tensor": {
            "shape": list(stacked.size),
            "mib": round(math.prod(stacked.size) * stacked.properties.dtype.itemsize / 2**20, 1),
        },
        "dist_ckpt_mib": round(sum(p.stat().st_size for p in (sample.role_dir / "dist_ckpt").iterdir()) / 2**20, 1),
        "plan_and_materialize": _in_child("plan", str(sample.role_dir)),
        "cli_merge": _in_child("merge", str(sample.role_dir), str(root / "merged")),
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
