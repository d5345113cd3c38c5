"""A spawned rank (``worker_main``): it joins the group, loads its shard, then mirrors rank 0's plans with
a ``FollowerRunner`` (tensor parallel) or runs a data-parallel engine of its own (``data_parallel``) until
rank 0 says stop.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.kv_cache import BlockTable, KVCacheManager
from engine.model_runner import ModelRunner
from engine.parallel.data_parallel import follow_front, lockstep_engine
from engine.parallel.group import Rendezvous, init_group
from engine.parallel.plans import DRAFT, ChunkPlan, StepPlan, WorkerSpec, moved, next_plan, share_drafts
from engine.spec_decode import build_proposer
from engine.spec_decode.proposer import Observation
from model.cache import BoundaryState
from model.causal_lm import CausalLM
from model.checkpoint import load_model
from model.tokenizer import load_tokenizer


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
                    Observation(d.request, self.state(d.request.id), d.start,
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


def worker_main(rank: int, world: int, meet: Rendezvous, device: str, timeout_s: float) -> None:
    """A spawned rank: join, receive rank 0's ``WorkerSpec``, load the shard, then run rank 0's step
    plans until it says stop."""
    context, control, store = init_group(rank, world, meet, device, timeout_s)
    received = [None]
    dist.broadcast_object_list(received, src=0, group=control)
    spec: WorkerSpec = received[0]
    torch.set_num_threads(spec.threads)
    config = spec.config
    context = dataclasses.replace(context, data_parallel=config.data_parallel)
    runner: FollowerRunner | None = None
    engine, error = None, None
    try:
        model = load_model(
            spec.path, spec.dtype, spec.device, spec.quantization, context, config.engram_offload
        )
        if context.data_parallel:
            engine = lockstep_engine(model, load_tokenizer(spec.path), config)
        else:
            cache = KVCacheManager.for_model(model, config, prefix=False)
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
    # Done, and rank 0 told: skip the interpreter's teardown, where destroying the store's client thread
    # can abort a rank that ran cleanly ("terminate called without an active exception", seen once in a
    # full test run), which its machine would report as a failed rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
