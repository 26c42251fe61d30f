"""What ``torchrun`` runs for ``hf_model`` with ``launcher: torchrun``.

Every rank gets its work on the command line; only rank 0 opens Dagster Pipes, to send progress
logs and the write report back to the run. Every rank's own output goes to the run's logs
through the subprocess's stdout/stderr.

    torchrun --nproc_per_node P -m merge_pipeline.dagster.torchrun_weights \
        --job JOB.json   (a WeightJob: the checkpoint, the staging folder, the options, the files the lead kept)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from merge_pipeline.errors import MergeError
from merge_pipeline.workers.die_with_parent import die_with_parent
from merge_pipeline.workers.torchrun import write_as_ranks
from merge_pipeline.workers.writing import WeightJob

REPORT_MESSAGE = "weights_written"  # the custom Pipes messages rank 0 sends
ERROR_MESSAGE = "merge_failed"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m merge_pipeline.dagster.torchrun_weights")
    parser.add_argument("--job", type=Path, required=True, help="the WeightJob's file (WeightJob.saved)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    die_with_parent()  # a rank outliving torchrun (killed with the run's worker) would write on unobserved
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(message)s", stream=sys.stderr)
    job = WeightJob.load(args.job)
    if rank != 0:
        try:
            write_as_ranks(job)
        except MergeError as exc:  # every rank raised the same agreed error; rank 0 reports it
            print(f"error: {exc}", file=sys.stderr)
        return 0
    from dagster_pipes import open_dagster_pipes

    with open_dagster_pipes() as pipes:
        pipes.log.info(f"torchrun merge of {job.local_dir} into {job.staging}: {os.environ.get('WORLD_SIZE')} ranks")
        try:
            written = write_as_ranks(job)
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
    code = main()
    # Leave without the interpreter's teardown: C++ objects of gloo's that outlive the process group can
    # still own a running thread, and destroying them at exit aborts the rank ("terminate called without
    # an active exception") after its files were written and reported.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
