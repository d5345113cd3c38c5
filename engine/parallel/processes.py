"""The ranks' processes, seen from rank 0: rank 0, the engine's process, schedules and samples; ranks
1..N-1 are spawned processes (``follower``) that load their own shard and run every forward rank 0 runs,
from the step plan it broadcasts (``plans``, sent by ``leader.LeaderRunner``). ``Workers`` starts them,
watches them and stops them. A worker that exits or stops answering turns rank 0's next step into a
``WorkerFailed`` naming the rank, within the group's timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.config import EngineConfig
from engine.parallel.follower import worker_main
from engine.parallel.group import Rendezvous, WorkerFailed, free_port, init_group
from engine.parallel.plans import (
    REPORT,
    STOP,
    RankReport,
    StepPlan,
    WorkerSpec,
)
from model.causal_lm import CausalLM
from model.checkpoint import load_model
from model.config import ModelConfig
from model.parallel.sharding import check_divisible

LOAD_TIMEOUT_S = 3600.0  # for every rank to read its shard (hundreds of GB for the large checkpoints)


class Workers:
    """Rank 0's handle on the spawned ranks: start-up, the step broadcast, the health check, shutdown."""

    def __init__(self, world: int, spec: WorkerSpec, meet: Rendezvous = Rendezvous()):
        """Spawn this machine's ranks after 0 (the others start with ``serve_node`` on their machines)."""
        data_parallel = spec.config.data_parallel
        check_divisible(ModelConfig.from_file(spec.path), world, data_parallel)  # before any process starts
        self.world, self.spec, self.closed = world, spec, False
        self.kind = "data-parallel" if data_parallel else "tensor-parallel"  # how errors name the ranks
        self.failed: WorkerFailed | None = None
        self.on_failure: Callable[[WorkerFailed], None] | None = None
        self.ranks = list(meet.ranks_here(world))[1:]
        meet = dataclasses.replace(meet, port=meet.port or free_port())
        self.processes = _spawn(self.ranks, world, meet, spec.device, spec.timeout_s)
        try:
            with self.guard():
                context, self.control, self.store = init_group(
                    0, world, meet, spec.device, spec.timeout_s, self.check
                )
                self.context = dataclasses.replace(context, data_parallel=data_parallel)
                dist.broadcast_object_list([spec], src=0, group=self.control)  # what every rank loads
        except BaseException:
            self.close()
            raise

    def ready(self) -> None:
        """Wait for every worker's shard to load, watching the processes (a load may take far longer than a
        collective's timeout); a worker's load error is raised here, naming its rank."""
        deadline, errors = time.monotonic() + LOAD_TIMEOUT_S, []
        try:
            for rank in range(1, self.world):
                while not self.store.check([f"loaded/{rank}"]):
                    self.check()
                    if time.monotonic() > deadline:
                        self._fail(WorkerFailed(f"{self.kind} rank {rank} did not load in time"))
                    time.sleep(0.05)
                if error := self.store.get(f"loaded/{rank}").decode():
                    errors.append(f"{self.kind} rank {rank}: {error}")
        except BaseException:
            self.close()
            raise
        if errors:
            self.close()
            raise ValueError("; ".join(errors))

    def broadcast(self, plan: StepPlan) -> None:
        self.check()
        dist.broadcast_object_list([plan], src=0, group=self.control)

    def reports(self, leader: RankReport) -> list[RankReport]:
        """Every rank's ``RankReport``, in rank order (``leader``: rank 0's own)."""
        with self.guard():
            self.broadcast(StepPlan(REPORT))
            return self.gather(leader)

    def gather(self, value: object) -> list:
        """Every rank's ``value``, in rank order (``value``: rank 0's)."""
        out = [None] * self.world
        dist.all_gather_object(out, value, group=self.control)
        return out

    def check(self) -> None:
        """Raise ``WorkerFailed`` naming the first rank whose process has exited (or the group's failure)."""
        if self.failed is not None:
            raise self.failed
        for rank, process in zip(self.ranks, self.processes, strict=True):
            if not process.is_alive():
                self._fail(WorkerFailed(f"{self.kind} rank {rank} exited with code {process.exitcode}"))

    def watch(self, on_failure: Callable[[WorkerFailed], None], interval_s: float = 0.5) -> None:
        """Call ``on_failure`` once when a worker dies, even while no step runs (a server's health)."""
        self.on_failure = on_failure

        def poll() -> None:
            while not self.closed and self.failed is None:
                with contextlib.suppress(WorkerFailed):
                    self.check()
                time.sleep(interval_s)

        threading.Thread(target=poll, name="tp-watchdog", daemon=True).start()

    def _fail(self, err: WorkerFailed) -> NoReturn:
        first = self.failed is None
        self.failed = self.failed or err
        if first and self.on_failure is not None:
            self.on_failure(err)
        raise err

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Turn a failed collective into a ``WorkerFailed`` that names the rank (a dead one if any: gloo
        reports a closed peer at once, a silent one after the group's timeout). Any error inside a step
        leaves the ranks out of step, so it is fatal to the group too."""
        try:
            yield
        except Exception as err:
            if isinstance(err, WorkerFailed):
                raise
            for process in self.processes:
                process.join(timeout=1.0)  # a dying worker's exit code settles
            self.check()
            ranks = ", ".join(str(r) for r in range(1, self.world))
            self._fail(WorkerFailed(f"a step with {self.kind} rank(s) {ranks} failed: {err}"))

    def close(self) -> None:
        """Stop the workers (asked, then terminated) and leave the group; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        # A failed group is out of step: its workers are killed, not asked.
        if self.failed is None and dist.is_initialized() and all(p.is_alive() for p in self.processes):
            with contextlib.suppress(Exception):
                dist.broadcast_object_list([StepPlan(STOP)], src=0, group=self.control)
        for process in self.processes:
            if self.failed is not None:
                process.kill()
            process.join(timeout=10.0)
            if process.is_alive():
                process.kill()
                process.join(timeout=5.0)
        if self.failed is None and dist.is_initialized():
            # A rank on another machine cannot be joined: rank 0 keeps its end of the group open until each
            # rank says it has left, as joining does here (closing first can abort a rank still leaving).
            with contextlib.suppress(Exception):
                self.store.wait([f"left/{rank}" for rank in range(1, self.world)], timedelta(seconds=10))
        if dist.is_initialized():
            dist.destroy_process_group()


def load_ranks(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    config: EngineConfig,
    quantization: str = "auto",
    meet: Rendezvous = Rendezvous(),
) -> tuple[CausalLM, Workers | None]:
    """Rank 0's model and, over several tensor- or data-parallel ranks, the started workers holding the
    other shards (closed again if anything fails on the way)."""
    if config.world_size == 1:
        return load_model(path, dtype, device, quantization, engram_offload=config.engram_offload), None
    spec = WorkerSpec(str(path), dtype, device.type, config, quantization)
    workers = Workers(config.world_size, spec, meet)
    try:
        model = load_model(
            path, dtype, device, quantization, parallel=workers.context, engram_offload=config.engram_offload
        )
        workers.ready()
    except BaseException:
        workers.close()
        raise
    return model, workers


def _spawn(ranks: list[int], world: int, meet: Rendezvous, device: str, timeout_s: float) -> list:
    spawn = mp.get_context("spawn")
    processes = [
        spawn.Process(
            target=worker_main,
            args=(rank, world, meet, device, timeout_s),
            daemon=True,
            name=f"tp-rank-{rank}",
        )
        for rank in ranks
    ]
    for process in processes:
        process.start()
    return processes


def serve_node(world: int, meet: Rendezvous, device: str, timeout_s: float = 300.0) -> int:
    """Run the ranks of a machine other than rank 0's until rank 0 stops them; the exit status is the
    first failing rank's (0 when all stopped cleanly)."""
    processes = _spawn(list(meet.ranks_here(world)), world, meet, device, timeout_s)
    for process in processes:
        process.join()
    return next((p.exitcode for p in processes if p.exitcode), 0)
