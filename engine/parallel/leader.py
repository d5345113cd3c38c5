"""Rank 0's runner under tensor parallelism: each step's plan goes to the workers (``processes.Workers``)
before rank 0 runs the same forward, and what rank 0 did to its caches in between rides on the next plan.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from engine.kv_cache import KVCacheManager
from engine.model_runner import ModelRunner, StepOutput
from engine.parallel.plans import (
    DRAFT,
    STEP,
    ChunkPlan,
    DraftPlan,
    RankReport,
    RequestRef,
    StepPlan,
    moved,
    report,
    share_drafts,
)
from engine.parallel.processes import Workers
from engine.request import Proposal
from engine.scheduler import ScheduledChunk
from engine.spec_decode.proposer import Observation, Proposer
from model.cache import BoundaryState


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
            ChunkPlan(
                RequestRef(c.request.id), c.start, c.length, c.token_ids, c.samples, c.num_drafts, c.scored
            )
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
