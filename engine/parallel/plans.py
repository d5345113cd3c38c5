"""What rank 0 and the other ranks send each other: the start-up ``WorkerSpec``, the per-step plans the
workers mirror (``StepPlan``: forwards, draft forwards and what rank 0 did to its caches in between),
and the ``RankReport`` they answer a report request with.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from model.cache import BoundaryState, KVPools, SavedCompressor
from model.parallel.modules import DispatchMoE

STEP, DRAFT, REPORT, STOP = "step", "draft", "report", "stop"


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
    scored: range = range(0)  # positions whose logits score prompt tokens: every rank projects the same rows


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
    named = [
        (f"{kind}.{i}.{part}", t)
        for kind in ("window", "entries", "index_keys")
        for i, rows in getattr(pools, kind).items()
        for part, t in vars(rows).items()
        if t is not None
    ]
    return {
        name: hashlib.sha256(t.cpu().contiguous().view(torch.uint8).numpy()).hexdigest() for name, t in named
    }


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
