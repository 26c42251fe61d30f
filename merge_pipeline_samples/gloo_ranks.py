"""Run a fixture writer's ranks as local processes joined by gloo.

Imports only the standard library and torch: the writers that use it run in their libraries' own venvs
(``scripts/setup_<library>.sh``), with this repository's root put first on their path.
"""

from __future__ import annotations

import os
import socket
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
