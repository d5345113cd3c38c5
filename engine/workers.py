"""Tensor-parallel workers: rank 0, the engine's process, schedules and samples; ranks 1..N-1 are spawned
processes that load their own shard and run every forward rank 0 runs, from the step plan it broadcasts
on a CPU (gloo) group. Data-parallel ranks start, meet and fail the same way and then run an engine of
their own (``engine.data_parallel``). The model's collectives run on the device's backend: gloo on cpu,
NCCL on cuda, HCCL on npu. A worker that exits or stops answering turns rank 0's next step into a
``WorkerFailed`` naming the rank, within the group's timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.config import EngineConfig
from engine.kv_cache import BlockTable, KVCacheManager
from engine.model_runner import ModelRunner, StepOutput
from engine.request import Proposal
from engine.scheduler import ScheduledChunk
from engine.spec_decode import build_proposer
from engine.spec_decode.proposer import Observation, Proposer
from model.cache import BoundaryState, KVPools, SavedCompressor, cache_groups
from model.causal_lm import CausalLM
from model.checkpoint import load_model
from model.config import ModelConfig
from model.parallel import DispatchMoE, ParallelContext, check_divisible
from model.tokenizer import load_tokenizer

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
STEP, DRAFT, REPORT, STOP = "step", "draft", "report", "stop"
JOIN_TIMEOUT_S = 300.0  # for the ranks to start (a fresh interpreter importing torch) and join the group
LOAD_TIMEOUT_S = 3600.0  # for every rank to read its shard (hundreds of GB for the large checkpoints)


class WorkerFailed(RuntimeError):
    """A tensor-parallel worker exited or stopped answering: the engine cannot step any more."""


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank loads and how it sizes its KV cache (the same on every rank)."""

    path: str
    dtype: torch.dtype
    device: str
    config: EngineConfig
    quantization: str = "auto"
    timeout_s: float = 300.0  # how long a collective waits for a silent rank (first steps compile kernels)
    # Replicated layers must compute bit-identical caches on every rank: on the CPU a matmul's result
    # depends on its thread count, so every rank uses rank 0's.
    threads: int = field(default_factory=torch.get_num_threads)


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


@dataclass(frozen=True)
class RequestRef:
    id: str


@dataclass(frozen=True)
class ChunkPlan:
    """A scheduled chunk as a worker's ``ModelRunner`` reads it."""

    request: RequestRef
    start: int
    length: int
    token_ids: list[int]
    samples: bool
    num_drafts: int = 0


@dataclass(frozen=True)
class DraftPlan:
    """One request's ``Observation`` after a step, as a worker's proposer reads it."""

    request: RequestRef
    start: int
    committed: int  # the chunk's tokens kept (the rows of its features the proposer sees)
    num_drafts: int
    next_ids: list[int]


@dataclass
class StepPlan:
    """What the workers mirror: with ``STEP`` the forward of ``chunks``, with ``DRAFT`` (speculative
    decoding, once rank 0 has sampled) the proposer's forwards over ``drafts``; either first applies what
    rank 0 did to its caches since the last plan."""

    command: str
    chunks: list[ChunkPlan] = field(default_factory=list)
    # The whole block tables of the step's requests: rank 0's manager grows them in place between steps.
    tables: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    released: list[str] = field(default_factory=list)
    # Prefix-cache hits: the blocks to copy (source, destination), the states (on the CPU) they resume from.
    copies: list[tuple[int, int]] = field(default_factory=list)
    resumes: dict[str, BoundaryState] = field(default_factory=dict)
    rollbacks: dict[str, int] = field(default_factory=dict)  # tokens each verifying chunk kept
    drafts: list[DraftPlan] = field(default_factory=list)


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
                raise WorkerFailed(
                    f"the tensor-parallel ranks did not all join within {JOIN_TIMEOUT_S:.0f} s"
                )
            time.sleep(0.05)
    else:
        store.add("joined", 1)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    control = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return ParallelContext(rank, world), control, store


@dataclass(frozen=True)
class RankReport:
    """One rank's state, for checks and benchmarks."""

    weight_bytes: int  # resident bytes of the model's checkpointed tensors
    cache_bytes: int
    checksums: dict[str, str]  # ``cache_checksums``: equal on every rank after any run
    expert_pairs: int = 0  # (token, expert) choices this rank's experts computed (data parallel)


def resident_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes the tensors' storages hold, each storage once (a stacked expert's views share one)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def report(runner: ModelRunner) -> RankReport:
    pools, model = runner.pools, runner.model
    weights, cache = resident_bytes(model.official_state().values()), pools.buffer.untyped_storage().nbytes()
    pairs = sum(m.pairs_computed for m in model.modules() if isinstance(m, DispatchMoE))
    return RankReport(weights, cache, cache_checksums(pools), pairs)


def cache_checksums(pools: KVPools) -> dict[str, str]:
    """A digest of every layer's pools, to check that replicated caches agree across ranks."""
    named = [(f"window.{i}", t) for i, t in pools.window.items()]
    named += [(f"entries.{i}", t) for i, t in pools.entries.items()]
    named += [(f"index_keys.{i}", t) for i, t in pools.index_keys.items()]
    return {
        name: hashlib.sha256(t.cpu().contiguous().view(torch.uint8).numpy()).hexdigest() for name, t in named
    }


class Workers:
    """Rank 0's handle on the spawned ranks: start-up, the step broadcast, the health check, shutdown."""

    def __init__(self, world: int, spec: WorkerSpec, meet: Rendezvous = Rendezvous()):
        """Spawn this machine's ranks after 0 (the others start with ``serve_node`` on their machines)."""
        data_parallel = spec.config.data_parallel_size > 1
        check_divisible(ModelConfig.from_file(spec.path), world, data_parallel)  # before any process starts
        self.world, self.spec, self.closed = world, spec, False
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
                        self._fail(WorkerFailed(f"tensor-parallel rank {rank} did not load in time"))
                    time.sleep(0.05)
                if error := self.store.get(f"loaded/{rank}").decode():
                    errors.append(f"tensor-parallel rank {rank}: {error}")
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
                self._fail(WorkerFailed(f"tensor-parallel rank {rank} exited with code {process.exitcode}"))

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
            self._fail(WorkerFailed(f"a step with tensor-parallel rank(s) {ranks} failed: {err}"))

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


def share_drafts(control: dist.ProcessGroup, drafts: list[int]) -> list[int]:
    """Rank 0's ``drafts`` on every rank (``ModelRunner.share`` under tensor parallelism)."""
    box = [drafts]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]


def moved(state: BoundaryState, device: torch.device) -> BoundaryState:
    """``state`` with its tensors on ``device``: a plan carries them on the CPU, each rank uses its own."""

    def saved(s: SavedCompressor) -> SavedCompressor:
        overlap = None if s.overlap is None else tuple(t.to(device) for t in s.overlap)
        return dataclasses.replace(s, overlap=overlap, device=device)

    history = None if state.engram_history is None else state.engram_history.to(device)
    return dataclasses.replace(
        state,
        compressors={layer: saved(s) for layer, s in state.compressors.items()},
        indexers={layer: saved(s) for layer, s in state.indexers.items()},
        engram_history=history,
    )


class LeaderRunner(ModelRunner):
    """Rank 0's runner: each step's plan goes to the workers before rank 0 runs the same forward, and
    when speculating a draft plan before the proposer's forwards; what rank 0 did to its caches in
    between (rollbacks, releases, prefix-cache hits) rides on the next plan."""

    def __init__(self, model: torch.nn.Module, cache: KVCacheManager, workers: Workers):
        super().__init__(model, cache)
        self.workers = workers
        self.pending = StepPlan(STEP)

    def _send(self, **plan: Any) -> None:
        """Broadcast ``plan`` with what rank 0 changed in its caches since the last one."""
        sent, self.pending = dataclasses.replace(self.pending, **plan), StepPlan(STEP)
        self.workers.broadcast(sent)

    def run(self, chunks: list[ScheduledChunk]) -> StepOutput:
        planned = [
            ChunkPlan(RequestRef(c.request.id), c.start, c.length, c.token_ids, c.samples, c.num_drafts)
            for c in chunks
        ]
        tables = {
            c.request.id: {name: list(t.blocks) for name, t in self.cache.tables[c.request.id].items()}
            for c in chunks
        }
        with self.workers.guard():
            self._send(chunks=planned, tables=tables)
            return super().run(chunks)

    def propose(self, proposer: Proposer, observations: list[Observation]) -> list[Proposal | None]:
        drafts = [
            DraftPlan(RequestRef(o.request.id), o.start, o.features.shape[0], o.num_drafts, o.next_ids)
            for o in observations
        ]
        with self.workers.guard():
            self._send(command=DRAFT, drafts=drafts)
            return super().propose(proposer, observations)

    def share(self, drafts: list[int]) -> list[int]:
        return share_drafts(self.workers.control, drafts)

    def resume(self, copies: list[tuple[int, int]], resumes: dict[str, BoundaryState]) -> None:
        super().resume(copies, resumes)
        self.pending.copies += copies
        self.pending.resumes.update({i: moved(state, torch.device("cpu")) for i, state in resumes.items()})

    def rollback(self, chunk: ScheduledChunk, keep: int) -> None:
        super().rollback(chunk, keep)
        self.pending.rollbacks[chunk.request.id] = keep

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self.pending.released.append(request_id)

    def reports(self) -> list[RankReport]:
        return self.workers.reports(report(self))


class RankZeroSamples:
    """A worker proposer's sampler: only rank 0 samples. The drafts a worker chains into a forward are
    rank 0's (``share``); the ones it proposes are dropped."""

    def draft(self, request: object, logits: torch.Tensor, drafted: list[int]) -> int:
        return 0


class FollowerRunner(ModelRunner):
    """A worker's runner: mirrors rank 0's plans on its own caches, and its proposer's forwards."""

    def __init__(
        self, model: CausalLM, cache: KVCacheManager, control: dist.ProcessGroup, config: EngineConfig
    ):
        super().__init__(model, cache)
        self.control = control
        self.proposer, _ = build_proposer(config, model, self.pools, RankZeroSamples(), share=self.share)
        self.chunks: dict[str, ChunkPlan] = {}  # the last step's, by request
        self.features: dict[str, torch.Tensor] = {}

    def follow(self, plan: StepPlan) -> None:
        """Mirror rank 0's changes since the last plan (rollbacks, releases, block tables updated in place:
        the runner's ``SeqCache`` holds the same lists, prefix-cache hits), then run the plan's forwards."""
        for request_id, keep in plan.rollbacks.items():
            self.rollback(self.chunks[request_id], keep)
        for request_id in plan.released:
            self.release(request_id)
        tables = self.cache.tables
        for request_id, groups in plan.tables.items():
            mine = tables.setdefault(request_id, {name: BlockTable() for name in groups})
            for name, blocks in groups.items():
                mine[name].blocks[:] = blocks
        self.resume(plan.copies, {i: moved(state, self.device) for i, state in plan.resumes.items()})
        if plan.command == DRAFT:
            if self.proposer is not None:  # rank 0's may be a given one, with no forwards of its own
                observations = [
                    Observation(d.request, self.seqs[d.request.id], d.start,
                                self.features[d.request.id][: d.committed], d.num_drafts, d.next_ids)
                    for d in plan.drafts
                ]  # fmt: skip
                self.propose(self.proposer, observations)
            return
        out = self.run(plan.chunks)
        self.chunks = {c.request.id: c for c in plan.chunks}
        self.features = dict(zip(self.chunks, out.features, strict=True))

    def share(self, drafts: list[int]) -> list[int]:
        return share_drafts(self.control, drafts)

    def resume(self, copies: list[tuple[int, int]], resumes: dict[str, BoundaryState]) -> None:
        super().resume(copies, resumes)
        for request_id in resumes:
            self._forget(request_id)

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self.cache.tables.pop(request_id, None)
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        if self.proposer is not None:
            self.proposer.release(request_id)


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
        return load_model(path, dtype, device, quantization), None
    spec = WorkerSpec(str(path), dtype, device.type, config, quantization)
    workers = Workers(config.world_size, spec, meet)
    try:
        model = load_model(path, dtype, device, quantization, parallel=workers.context)
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


def worker_main(rank: int, world: int, meet: Rendezvous, device: str, timeout_s: float) -> None:
    """A spawned rank: join, receive rank 0's ``WorkerSpec``, load the shard, then run rank 0's step
    plans until it says stop."""
    context, control, store = init_group(rank, world, meet, device, timeout_s)
    received = [None]
    dist.broadcast_object_list(received, src=0, group=control)
    spec: WorkerSpec = received[0]
    torch.set_num_threads(spec.threads)
    config = spec.config
    context = dataclasses.replace(context, data_parallel=config.data_parallel_size > 1)
    runner: FollowerRunner | None = None
    engine, error = None, None
    try:
        model = load_model(spec.path, spec.dtype, spec.device, spec.quantization, parallel=context)
        if context.data_parallel:
            # Imported here: the data-parallel engine is built on this module.
            from engine.data_parallel import follow_front, lockstep_engine

            engine = lockstep_engine(model, load_tokenizer(spec.path), config)
        else:
            groups = cache_groups(model.cfg, model.embed.weight.element_size())
            cache = KVCacheManager.from_budget(groups, config.block_size, config.kv_cache_memory)
            runner = FollowerRunner(model, cache, control, config)
    except Exception as err:  # reported to rank 0, which raises it naming this rank
        error = f"{type(err).__name__}: {err}"
    store.set(f"loaded/{rank}", error or "")
    if engine is not None:
        follow_front(engine, control, rank, world)
    while runner is not None and (plan := next_plan(control, world, runner)) is not None:
        runner.follow(plan)
    dist.destroy_process_group()
    store.set(f"left/{rank}", "")


def next_plan(control: dist.ProcessGroup, world: int, runner: ModelRunner) -> Any:
    """A worker's next step plan from rank 0, answering report requests on the way; None: stop."""
    while True:
        received = [None]
        dist.broadcast_object_list(received, src=0, group=control)
        plan = received[0]
        if plan.command == STOP:
            return None
        if plan.command != REPORT:
            return plan
        dist.all_gather_object([None] * world, report(runner), group=control)
