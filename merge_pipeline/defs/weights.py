"""The weight-writing stage of ``hf_model``: in the run's own process, or across torchrun processes.

``write_in_process`` streams the safetensors shards of the plan the asset already built into the
staging folder; ``write_with_torchrun`` launches torchrun through Dagster Pipes, each rank planning
its share itself. ``MergeConfig.launcher`` picks one.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import dagster as dg

from merge_pipeline.defs.config import MergeConfig
from merge_pipeline.defs.torchrun_weights import ERROR_MESSAGE, REPORT_MESSAGE, command_line
from merge_pipeline.errors import MergeError, first_line
from merge_pipeline.options import MergeOptions
from merge_pipeline.pipeline import OutputPlan, WriteReport, peak_rss_bytes, write_weights


@dataclass(frozen=True)
class WeightJob:
    role_dir: Path
    staging: Path  # beside the target: the shards are renamed into place with the rest of the folder
    options: MergeOptions  # with the backend the plan found: the ranks do not detect it again


@dataclass(frozen=True)
class WrittenWeights:
    report: WriteReport
    peak_rss_bytes: int
    peak_rss_label: str  # whose peak: the run's whole process (Dagster and imports included), or the largest rank


def write_in_process(outputs: OutputPlan, staging: Path) -> WrittenWeights:
    report = write_weights(outputs, staging)
    return WrittenWeights(report, peak_rss_bytes(), "peak RSS (whole process)")


def write_with_torchrun(context: dg.AssetExecutionContext, job: WeightJob, config: MergeConfig) -> WrittenWeights:
    """The same job split across torchrun ranks; rank 0 sends the report back through Pipes."""
    if config.nnodes == 1:
        rendezvous = ["--standalone"]
    else:  # this node is rank 0; the others run the same torchrun line with their own --node-rank
        rendezvous = [
            "--nnodes",
            str(config.nnodes),
            "--node-rank",
            "0",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            config.rdzv_endpoint,
        ]
    torchrun = str(Path(sys.executable).parent / "torchrun")
    command = [
        torchrun,
        *rendezvous,
        "--nproc_per_node",
        str(config.nproc_per_node),
        "-m",
        "merge_pipeline.defs.torchrun_weights",
        *command_line(job.role_dir, job.staging, job.options),
    ]
    context.log.info("launching: %s", " ".join(command))
    try:
        invocation = dg.PipesSubprocessClient(env={"OMP_NUM_THREADS": "1"}).run(context=context, command=command)
    except dg.DagsterPipesExecutionError as exc:  # a rank died (killed, out of memory): no report came back
        raise MergeError(
            job.staging,
            f"torchrun failed before the ranks agreed on a result ({first_line(exc)}); each rank's output is in the run's logs",
        ) from None
    messages = {m.get("kind"): m for m in invocation.get_custom_messages()}
    if ERROR_MESSAGE in messages:
        raise MergeError(None, messages[ERROR_MESSAGE]["message"])
    report = messages[REPORT_MESSAGE]
    return WrittenWeights(
        WriteReport(report["files"], report["seconds"]), report["peak_rss_bytes"], "peak RSS (largest rank)"
    )
