"""How the ranks meet and fail: where they meet (``Rendezvous``: one machine, several, or torchrun's
agent store), joining the group (the model's collectives on the device's backend: gloo on cpu, NCCL on
cuda, HCCL on npu; the plans on a CPU gloo group), and ``WorkerFailed``, what rank 0 raises when a rank
exits or stops answering.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from model.parallel.context import ParallelContext

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
JOIN_TIMEOUT_S = 300.0  # for the ranks to start (a fresh interpreter importing torch) and join the group


class WorkerFailed(RuntimeError):
    """A tensor- or data-parallel worker exited or stopped answering: the engine cannot step any more."""


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet (rank 0's machine and port) and how they spread over ``nnodes`` machines,
    ``world / nnodes`` consecutive ranks each; one machine meets on a free local port."""

    addr: str = "127.0.0.1"
    port: int = 0
    nnodes: int = 1
    node_rank: int = 0
    # A launcher's store already serves at addr:port (torchrun's agent): every rank joins it, keeping its
    # keys under this prefix; "": rank 0 serves the store.
    launcher_store: str = ""

    def ranks_here(self, world: int) -> range:
        if self.nnodes < 1 or world % self.nnodes:
            raise ValueError(f"tensor_parallel_size={world} does not divide over nnodes={self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be in [0, {self.nnodes})")
        if self.nnodes > 1 and not self.port:
            raise ValueError(f"nnodes={self.nnodes}: the nodes meet on a given master port, not port 0")
        per_node = world // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(
    rank: int,
    world: int,
    meet: Rendezvous,
    device: str,
    timeout_s: float,
    watch: Callable[[], None] | None = None,
) -> tuple[ParallelContext, dist.ProcessGroup, dist.Store]:
    """Join the group at ``meet``; returns the model's context, the CPU group the step plans travel on
    and the group's store. Rank 0 hosts the store and calls ``watch`` while it waits for the others to
    join, so a worker that dies before joining fails the start at once rather than after the timeout."""
    backend = BACKENDS[device]
    if device != "cpu":
        getattr(torch, device).set_device(rank % (world // meet.nnodes))  # the device on its own machine
    timeout = timedelta(seconds=timeout_s)
    serves = rank == 0 and not meet.launcher_store
    store = dist.TCPStore(meet.addr, meet.port, world, serves, timeout, wait_for_workers=False)
    if meet.launcher_store:
        store = dist.PrefixStore(meet.launcher_store, store)
    if rank == 0:
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while store.add("joined", 0) < world - 1:
            if watch is not None:
                watch()
            if time.monotonic() > deadline:
                raise WorkerFailed(f"not all {world} ranks joined within {JOIN_TIMEOUT_S:.0f} s")
            time.sleep(0.05)
    else:
        store.add("joined", 1)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    control = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return ParallelContext(rank, world), control, store
