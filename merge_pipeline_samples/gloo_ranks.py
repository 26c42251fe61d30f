"""Run a fixture writer's ranks as local processes joined by gloo.

Imports only the standard library and torch: the writers that use it run in their libraries' own venvs
(``scripts/setup_<library>.sh``), with this repository's root put first on their path.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
from collections.abc import Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def spawn_gloo_ranks(save: Callable[..., None], args: tuple, world_size: int) -> None:
    """``save(rank, world_size, *args)`` in each of ``world_size`` spawned processes, inside one gloo group."""
    with socket.socket() as probe:  # a free port for the ranks' rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_rank, args=(save, args, world_size, port), nprocs=world_size)


def _rank(rank: int, save: Callable[..., None], args: tuple, world_size: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        save(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    _leave_without_teardown()


def _leave_without_teardown() -> None:
    """End a rank that finished without the interpreter's teardown: gloo's C++ objects that outlive the process
    group can still own a running thread, and destroying them at exit aborts the rank ("terminate called without
    an active exception", pytorch/gloo#155) after its files were written (seen in CI rehearsals with the
    torchtitan and NeMo-Automodel writers). The rank's own child processes (a multiprocessing manager's server,
    which megatron-core's saving starts) are killed first: skipped teardown would leave them holding the writer's
    output pipes open, and whoever reads them waiting. SIGKILL, as SIGTERM may be ignored: processes inherit
    ignored signals, and CI's tree ignores SIGTERM (a CI rehearsal hung on a manager that outlived terminate())."""
    for child in multiprocessing.active_children():
        child.kill()
        child.join()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
