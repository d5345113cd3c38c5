"""Runs one step: the chunks of every scheduled request as one flat batch over the paged KV pools.

The per-step metadata (positions, request of each token, block tables, window slots) is built
vectorised by ``model.cache.Batch`` from the cache manager's tables; the model then reads and
writes every request's KV by slot. Small per-request state (compressor buffers, Engram look-back)
lives in the request's ``SeqCache``; a chunk starting at position 0 (new or preempted) starts over.
A chunk that verifies drafts journals that state first, so ``rollback`` can keep its accepted prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv_cache import KVCacheManager
from engine.scheduler import ScheduledChunk
from model.cache import Batch, KVPools, SeqCache
from model.causal_lm import CausalLM


@dataclass
class StepOutput:
    logits: list[torch.Tensor]  # per sampling chunk, in order: [1 + num_drafts, V] at its last positions
    features: list[torch.Tensor]  # per chunk: the draft head's input for each of its tokens


class ModelRunner:
    def __init__(self, model: CausalLM, cache: KVCacheManager):
        self.model, self.cache = model, cache
        weight = model.embed.weight
        self.device = weight.device
        self.pools = KVPools(model.cfg, cache.layout, cache.num_blocks, weight.dtype, weight.device)
        self.seqs: dict[str, SeqCache] = {}

    @torch.no_grad()
    def run(self, chunks: list[ScheduledChunk]) -> StepOutput:
        seqs, ids, rows, counts = [], [], [], []
        for chunk in chunks:
            request = chunk.request
            if chunk.start == 0:  # the manager's table lists are shared, so the model sees every allocation
                tables = {name: table.blocks for name, table in self.cache.tables[request.id].items()}
                self.seqs[request.id] = SeqCache(tables)
            seq = self.seqs[request.id]
            if chunk.num_drafts:
                seq.speculate()
            seqs.append(seq)
            ids.extend(chunk.token_ids)
            if chunk.samples:
                counts.append(chunk.num_drafts + 1)
                rows.extend(range(len(ids) - counts[-1], len(ids)))
        batch = Batch.build(self.pools, seqs, [c.length for c in chunks], self.device)
        tokens = torch.tensor(ids, device=self.device)
        logits, features = self.model.batch_forward(
            tokens, batch, torch.tensor(rows, dtype=torch.long, device=self.device)
        )
        return StepOutput(list(logits.split(counts)), list(features.split([c.length for c in chunks])))

    @torch.no_grad()
    def rollback(self, chunk: ScheduledChunk, keep: int) -> None:
        """Keep the first ``keep`` tokens of a chunk that verified drafts: caches as if only they came."""
        kept = torch.tensor(chunk.token_ids[:keep], device=self.device)
        self.model.rollback(self.seqs[chunk.request.id], kept)

    def release(self, request_id: str) -> None:
        self.seqs.pop(request_id, None)
