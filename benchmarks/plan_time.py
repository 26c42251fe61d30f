"""Seconds a checkout's ``open_checkpoint`` takes to plan one role folder (imports excluded), as JSON.

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
    parser = argparse.ArgumentParser(prog="python benchmarks/plan_time.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("role_dir", type=Path)
    parser.add_argument("--hf_model_path")
    args = parser.parse_args(argv)

    from merge_pipeline.formats import open_checkpoint
    from merge_pipeline.options import MergeOptions

    started = time.perf_counter()
    plan = open_checkpoint(args.role_dir, MergeOptions(hf_model_path=args.hf_model_path))
    seconds = time.perf_counter() - started
    with plan:
        print(json.dumps({"plan_s": round(seconds, 3), "tensors": len(plan.tensors), "files": len(plan.files)}))


if __name__ == "__main__":
    main()
