"""The weight-writing step of ``merged_state_dict``, behind one function signature so it can be swapped.

A writer takes a ``WeightJob`` and streams the safetensors shards into the staging
folder; ``write_in_process`` does it in the run's own process, ``write_with_torchrun`` across
torchrun processes launched through Dagster Pipes. ``MergeConfig.launcher`` picks one.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import dagster as dg

from merge_pipeline.defs.config import MergeConfig
from merge_pipeline.defs.torchrun_weights import ERROR_MESSAGE, REPORT_MESSAGE, command_line
from merge_pipeline.engine.merge import WriteReport, peak_rss_bytes, prepare, write_weights
from merge_pipeline.engine.outputs import MergeOptions
from merge_pipeline.errors import MergeError


@dataclass(frozen=True)
class WeightJob:
    role_dir: Path
    backend: str
    staging: Path  # empty, beside the target: the shards are renamed into place with the rest
    options: MergeOptions


@dataclass(frozen=True)
class WrittenWeights:
    report: WriteReport
    peak_rss_bytes: int  # of the process(es) that did the writing


def write_in_process(job: WeightJob) -> WrittenWeights:
    plan, _, layout = prepare(job.role_dir, job.options, job.backend)
    with plan:
        report = write_weights(layout, job.staging)
    return WrittenWeights(report, peak_rss_bytes())


def write_with_torchrun(context: dg.AssetExecutionContext, job: WeightJob, config: MergeConfig) -> WrittenWeights:
    """The same job split across torchrun ranks; rank 0 sends the report back through Pipes."""
    if config.nnodes == 1:
        rendezvous = ["--standalone"]
    else:  # this node is rank 0; the others run the same torchrun line with their own --node-rank
        rendezvous = ["--nnodes", str(config.nnodes), "--node-rank", "0", "--rdzv-backend", "c10d", "--rdzv-endpoint", config.rdzv_endpoint]
    torchrun = str(Path(sys.executable).parent / "torchrun")
    command = [torchrun, *rendezvous, "--nproc_per_node", str(config.nproc_per_node), "-m", "merge_pipeline.defs.torchrun_weights", *command_line(job.role_dir, job.backend, job.staging, job.options)]
    context.log.info("launching: %s", " ".join(command))
    try:
        invocation = dg.PipesSubprocessClient(env={"OMP_NUM_THREADS": "1"}).run(context=context, command=command)
    except dg.DagsterPipesExecutionError as exc:  # a rank died (killed, out of memory): no report came back
        raise MergeError(job.staging, f"torchrun failed before the ranks agreed on a result ({str(exc).splitlines()[0]}); each rank's output is in the run's logs") from None
    messages = {m.get("kind"): m for m in invocation.get_custom_messages()}
    if ERROR_MESSAGE in messages:
        raise MergeError(None, messages[ERROR_MESSAGE]["message"])
    report = messages[REPORT_MESSAGE]
    return WrittenWeights(WriteReport(report["files"], report["seconds"]), report["peak_rss_bytes"])
