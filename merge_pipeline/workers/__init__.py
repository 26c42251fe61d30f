"""Who writes a merge's weight files, side by side, and the one place every entry point picks them.

    writing     what workers are handed (the lead's plan, a ``WeightJob``) and write (``write_share``)
    in_process  the ``Workers`` interface of ``pipeline.merge``, and ``IN_PROCESS``: this process writes all
    torchrun    ``TorchrunRanks``: this process and its torchrun peers, rank 0 leading
    ray_tasks   ``RayTasks``: this process leads, Ray tasks on a cluster write
    ray_probe   whether a Ray head answers at an address, asked in seconds before ``ray_tasks`` connects
    remote      a worker whose lead is another process: plan, then write its files (torchrun ranks, a Ray task)

Dagster's step launching torchrun ranks through Pipes (``dagster.weights.TorchrunLaunch``) needs Dagster,
which nothing here imports: Dagster hands it to ``workers_for``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, Literal

from merge_pipeline.errors import MergeError
from merge_pipeline.ray_settings import RaySettings
from merge_pipeline.workers.in_process import IN_PROCESS, Workers

Launcher = Literal["inprocess", "torchrun", "ray"]
LAUNCHERS: tuple[Launcher, ...] = ("inprocess", "torchrun", "ray")
_log = logging.getLogger("merge_pipeline")


@contextlib.contextmanager
def workers_for(
    launcher: Launcher,
    *,
    ray: RaySettings | None = None,
    launch_torchrun: Callable[[], Workers] | None = None,
    dist_timeout: float | None = None,
    log: Any = _log,
) -> Iterator[Workers]:
    """The workers of one merge, for as long as it runs: the CLI's ``merge`` and ``average`` and Dagster's
    ``hf_model`` and ``averaged_model`` all get theirs here.

    ``inprocess``: this process. ``ray``: tasks on the cluster ``ray`` describes, this process their driver
    (Ray and its head are checked now, before any work). ``torchrun``: with ``launch_torchrun``, the ranks
    it launches (Dagster's step); without, this process is one of torchrun's ranks (the CLI under torchrun:
    every rank runs the merge) and waits at most ``dist_timeout`` for its peers. ``log``: where the driver
    of Ray tasks reports (this logger, or a Dagster run's)."""
    if launcher == "ray":
        from merge_pipeline.workers.ray_tasks import RayTasks  # imports Ray only when a merge asks for it

        yield RayTasks(ray or RaySettings(), log)
    elif launcher == "torchrun" and launch_torchrun is not None:
        yield launch_torchrun()
    elif launcher == "torchrun":
        from merge_pipeline.workers.torchrun import torchrun_ranks

        with torchrun_ranks(dist_timeout) as ranks:
            yield ranks
    elif launcher == "inprocess":
        yield IN_PROCESS
    else:
        raise MergeError(None, f"launcher {launcher!r}: expected one of {', '.join(LAUNCHERS)}")
