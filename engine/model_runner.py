"""Runs one step: the chunks of every scheduled request as one flat batch over the paged KV pools.

The per-step metadata (positions, request of each token, block tables, window slots) is built
vectorised by ``model.cache.Batch`` from the cache manager's tables; the model then reads and
writes every request's KV by slot. Small per-request state (compressor buffers, Engram look-back)
lives in the request's ``SeqCache``; a chunk starting at position 0 (new or preempted) starts over.
"""

from __future__ import annotations

import torch

from engine.kv_cache import KVCacheManager
from engine.scheduler import ScheduledChunk
from model.cache import Batch, KVPools, SeqCache
from model.deepseek_v4 import DeepseekV4
from model.deepseek_v41 import DeepseekV41


class ModelRunner:
    def __init__(self, model: DeepseekV4 | DeepseekV41, cache: KVCacheManager):
        self.model, self.cache = model, cache
        weight = model.embed.weight
        self.device = weight.device
        self.pools = KVPools(model.cfg, cache.block_size, cache.num_blocks, weight.dtype, weight.device)
        if self.pools.slots_per_block != cache.slots_per_block:
            raise ValueError("the KV pools and the cache manager disagree on the block layout")
        self.seqs: dict[str, SeqCache] = {}

    @torch.no_grad()
    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Logits ``[n, V]`` of the last position of each chunk that samples, in order."""
        seqs, ids, last = [], [], []
        for chunk in chunks:
            request = chunk.request
            if chunk.start == 0:  # the manager's table lists are shared, so the model sees every allocation
                tables = {name: table.blocks for name, table in self.cache.tables[request.id].items()}
                self.seqs[request.id] = SeqCache(tables)
            seq = self.seqs[request.id]
            seqs.append(seq)
            ids.extend(request.tokens[chunk.start : chunk.start + chunk.length])
            if chunk.samples:
                last.append(len(ids) - 1)
        batch = Batch.build(self.pools, seqs, [c.length for c in chunks], self.device)
        tokens = torch.tensor(ids, device=self.device)
        return self.model.batch_logits(
            tokens, batch, torch.tensor(last, dtype=torch.long, device=self.device)
        )

    def release(self, request_id: str) -> None:
        self.seqs.pop(request_id, None)
