"""What ``torchrun`` runs for ``hf_model`` with ``launcher: torchrun``.

Every rank gets its work on the command line; only rank 0 opens Dagster Pipes, to send progress
logs and the write report back to the run. Every rank's own output goes to the run's logs
through the subprocess's stdout/stderr.

    torchrun --nproc_per_node P -m merge_pipeline.defs.torchrun_weights \
        --local_dir D --staging S --options '{"dtype": "bfloat16", ...}'
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import asdict
from pathlib import Path

from merge_pipeline.dagster.die_with_parent import die_with_parent
from merge_pipeline.distributed import write_weights_distributed
from merge_pipeline.errors import MergeError
from merge_pipeline.options import MergeOptions
from merge_pipeline.pipeline import WeightJob

REPORT_MESSAGE = "weights_written"  # the custom Pipes messages rank 0 sends
ERROR_MESSAGE = "merge_failed"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m merge_pipeline.defs.torchrun_weights")
    parser.add_argument("--local_dir", type=Path, required=True)
    parser.add_argument("--staging", type=Path, required=True)
    parser.add_argument("--options", type=json.loads, required=True, help="MergeOptions fields as JSON")
    return parser.parse_args(argv)


def command_line(job: WeightJob) -> list[str]:
    """The arguments after ``-m merge_pipeline.defs.torchrun_weights``: the inverse of ``parse_args``."""
    return [
        "--local_dir",
        str(job.local_dir),
        "--staging",
        str(job.staging),
        "--options",
        json.dumps(asdict(job.options)),
    ]


def main(argv: list[str] | None = None) -> int:
    die_with_parent()  # a rank outliving torchrun (killed with the run's worker) would write on unobserved
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(message)s", stream=sys.stderr)
    job = WeightJob(args.local_dir, args.staging, MergeOptions(**args.options))
    if rank != 0:
        try:
            write_weights_distributed(job)
        except MergeError as exc:  # every rank raised the same agreed error; rank 0 reports it
            print(f"error: {exc}", file=sys.stderr)
        return 0
    from dagster_pipes import open_dagster_pipes

    with open_dagster_pipes() as pipes:
        pipes.log.info(f"torchrun merge of {args.local_dir} into {args.staging}: {os.environ.get('WORLD_SIZE')} ranks")
        try:
            written = write_weights_distributed(job)
        except MergeError as exc:
            # A clean, agreed failure: the asset raises this one line, so torchrun itself succeeds.
            pipes.report_custom_message({"kind": ERROR_MESSAGE, "message": str(exc)})
            return 0
        report = written.report
        pipes.report_custom_message(
            {
                "kind": REPORT_MESSAGE,
                "files": report.files,
                "seconds": report.seconds,
                "peak_rss_bytes": written.peak_rss_bytes,
            }
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
