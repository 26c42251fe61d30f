"""Who writes the weights of ``hf_model`` and ``averaged_model``: the run's own process, torchrun ranks it
launches, or Ray tasks, as ``workers.workers_for`` picks them for the CLI too.

Each is a ``Workers`` of the one merge sequence (``pipeline.merge``): the step leads either way (it
holds the target's lock, keeps what a killed merge finished, writes the side files, checks and
publishes). With ``launcher: torchrun`` the weights are written by ranks launched through Dagster
Pipes (``TorchrunLaunch``, here: it needs Dagster), each planning its share itself and reusing the files
the step kept; with ``launcher: ray`` by Ray tasks on the cluster at ``ray_address`` (``workers.ray_tasks``),
the step being their driver. An average is the same merge sequence on averaged inputs (its options carry
them, so every worker plans the same average).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import dagster as dg

from merge_pipeline.dagster.run_config import LauncherConfig
from merge_pipeline.dagster.torchrun_weights import ERROR_MESSAGE, REPORT_MESSAGE
from merge_pipeline.errors import MergeError, first_line
from merge_pipeline.workers import workers_for
from merge_pipeline.workers.in_process import Workers
from merge_pipeline.workers.writing import Prepared, WeightJob, WriteReport, Written


@contextmanager
def step_workers(context: dg.AssetExecutionContext, config: LauncherConfig) -> Iterator[Workers]:
    """The step's workers, from its run config; the driver of Ray tasks reports to the run's log."""
    with workers_for(
        config.launcher,
        ray=config.ray_settings() if config.launcher == "ray" else None,
        launch_torchrun=lambda: TorchrunLaunch(context, config),
        log=context.log,
    ) as workers:
        yield workers


class TorchrunLaunch(Workers):
    """The step leads in its own process; the weights are the job of torchrun ranks, rank 0 sending the
    report back through Pipes."""

    def __init__(self, context: dg.AssetExecutionContext, config: LauncherConfig):
        self.context, self.config = context, config

    def write(self, job: WeightJob, prepared: Prepared, *, show_progress: bool) -> Written:
        job = job.planned_as(prepared)
        command = [
            sys.executable,
            "-m",
            "merge_pipeline.workers.die_with_parent",  # torchrun and its ranks die with this run's worker
            str(Path(sys.executable).parent / "torchrun"),
            *self._rendezvous(),
            "--nproc_per_node",
            str(self.config.nproc_per_node),
            "-m",
            "merge_pipeline.dagster.torchrun_weights",
            "--job",
            str(job.saved()),
        ]
        self.context.log.info("launching: %s", " ".join(command))
        try:
            invocation = dg.PipesSubprocessClient(env={"OMP_NUM_THREADS": "1"}).run(
                context=self.context, command=command
            )
        # A rank died (killed, out of memory): no report came back. Dagster raises DagsterPipesExecutionError,
        # which it does not export (`dg.` has no such name: naming it failed as AttributeError here).
        except Exception as exc:
            raise MergeError(
                job.staging,
                f"torchrun failed before the ranks agreed on a result ({first_line(exc)}); each rank's output is in the run's logs",
            ) from None
        messages = {m.get("kind"): m for m in invocation.get_custom_messages()}
        if ERROR_MESSAGE in messages:
            raise MergeError(None, messages[ERROR_MESSAGE]["message"])
        report = messages[REPORT_MESSAGE]
        return Written(
            WriteReport(report["files"], report["seconds"]), report["peak_rss_bytes"], "peak RSS (largest rank)"
        )

    def _rendezvous(self) -> list[str]:
        if self.config.nnodes == 1:
            return ["--standalone"]
        # this node is rank 0; the others run the same torchrun line with their own --node-rank
        return [
            "--nnodes",
            str(self.config.nnodes),
            "--node-rank",
            "0",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            self.config.rdzv_endpoint,
        ]
