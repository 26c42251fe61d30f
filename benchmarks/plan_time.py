"""Seconds (wall and CPU) a checkout's ``open_checkpoint`` takes to plan one role folder (imports
excluded), as JSON.

    python benchmarks/plan_time.py ROLE_DIR [--hf_model_path DIR]

Run as a file, so that ``PYTHONPATH`` alone picks the checkout measured (``benchmarks.world_sizes
--plan`` runs it beside each merge; its peak RSS comes from ``wait4``, as the merge's).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plan_time", description=__doc__.split("\n\n")[0])
    parser.add_argument("role_dir", type=Path)
    parser.add_argument("--hf_model_path")
    args = parser.parse_args(argv)

    from merge_pipeline.formats import open_checkpoint
    from merge_pipeline.options import MergeOptions

    started, cpu = time.perf_counter(), time.process_time()
    plan = open_checkpoint(args.role_dir, MergeOptions(hf_model_path=args.hf_model_path))
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    with plan:
        print(json.dumps({"plan_s": round(seconds, 3), "plan_cpu_s": round(cpu, 3), "tensors": len(plan.tensors)}))


if __name__ == "__main__":
    main()
