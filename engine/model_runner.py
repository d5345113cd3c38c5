"""Runs one step: the chunks of every scheduled request as one flat batch over the paged KV pools.

The per-step metadata (positions, request of each token, block tables, window slots) is built
vectorised by ``model.cache.Batch`` from the cache manager's tables; the model then reads and
writes every request's KV by slot. Small per-request state (compressor buffers, Engram look-back)
lives in the request's ``SeqCache``; a chunk starting at position 0 (new or preempted) starts over.
A chunk that verifies drafts journals that state first, so ``rollback`` can keep its accepted prefix.
The LM head projects only the rows the step needs: each sampling chunk's last ones, and the positions
that score prompt tokens for requests asking for prompt logprobs (``scored_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.decode_graphs import DecodeGraphs
from engine.kv_cache import KVCacheManager
from engine.request import Proposal
from engine.scheduler import ScheduledChunk
from engine.spec_decode.proposer import Observation, Proposer
from model.cache import Batch, BoundaryState, KVPools, SeqCache
from model.causal_lm import CausalLM


@dataclass
class StepOutput:
    logits: list[torch.Tensor]  # per sampling chunk, in order: [1 + num_drafts, V] at its last positions
    features: list[torch.Tensor]  # per chunk: the draft head's input for each of its tokens
    prompt_logits: list[torch.Tensor]  # per chunk: [len(chunk.scored), V] at its scored prompt positions


class ModelRunner:
    def __init__(self, model: CausalLM, cache: KVCacheManager):
        self.model, self.cache = model, cache
        weight = model.embed.weight
        self.device = weight.device
        self.pools = KVPools(model.cfg, cache.layout, cache.num_blocks, weight.dtype, weight.device)
        self._seqs: dict[str, SeqCache] = {}  # per running request: its caches' state
        self.graphs: DecodeGraphs | None = None  # decode steps replayed as graphs; None: every step eager

    @torch.no_grad()
    def run(self, chunks: list[ScheduledChunk]) -> StepOutput:
        seqs, ids, rows, counts = [], [], [], []
        for chunk in chunks:
            request = chunk.request
            if chunk.start == 0:  # the manager's table lists are shared, so the model sees every allocation
                tables = {name: table.blocks for name, table in self.cache.tables[request.id].items()}
                self._seqs[request.id] = SeqCache(tables)
            seq = self._seqs[request.id]
            if chunk.num_drafts:
                seq.speculate()
            seqs.append(seq)
            ids.extend(chunk.token_ids)
            if chunk.samples:
                counts.append(chunk.num_drafts + 1)
                rows.extend(range(len(ids) - counts[-1], len(ids)))
        lengths = [c.length for c in chunks]
        tokens = torch.tensor(ids, device=self.device)
        scored, scored_counts = scored_rows(chunks)
        graphed = self.graphs is not None and not scored and decoding(chunks)
        shape = self.graphs.handles(seqs, lengths) if graphed else None
        if shape is not None:
            logits, features = self.graphs.run(shape, seqs, tokens)
        else:
            batch = Batch.build(self.pools, seqs, lengths, self.device)
            logits, features = self.model.batch_forward(
                tokens, batch, torch.tensor(rows + scored, dtype=torch.long, device=self.device)
            )
        sampled, prompt = logits[: len(rows)], logits[len(rows) :]
        return StepOutput(
            list(sampled.split(counts)), list(features.split(lengths)), list(prompt.split(scored_counts))
        )

    def state(self, request_id: str) -> SeqCache:
        """A running request's cache state (what the proposers and the engine's checkpoints read)."""
        return self._seqs[request_id]

    @torch.no_grad()
    def rollback(self, chunk: ScheduledChunk, keep: int) -> None:
        """Keep the first ``keep`` tokens of a chunk that verified drafts: caches as if only they came."""
        kept = torch.tensor(chunk.token_ids[:keep], device=self.device)
        self.model.rollback(self._seqs[chunk.request.id], kept)

    def resume(self, copies: list[tuple[int, int]], resumes: dict[str, BoundaryState]) -> None:
        """Requests admitted on a prefix-cache hit continue from the checkpoint's state, over copies
        (source, destination) of the blocks their boundary falls inside."""
        buffer = self.pools.buffer
        for source, destination in copies:
            buffer[destination] = buffer[source]
        for request_id, state in resumes.items():
            tables = {name: table.blocks for name, table in self.cache.tables[request_id].items()}
            self._seqs[request_id] = state.resume(tables)

    def propose(self, proposer: Proposer, observations: list[Observation]) -> list[Proposal | None]:
        """The proposer's drafts after a step (its forwards run on this runner's caches)."""
        return proposer.propose(observations) if observations else []

    def share(self, drafts: list[int]) -> list[int]:
        """Drafts a proposer feeds into a further forward, as rank 0 drew them (one process: as given)."""
        return drafts

    def release(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)


def decoding(chunks: list[ScheduledChunk]) -> bool:
    """Every chunk continues its request and samples at each of its tokens (1 + drafts): a decode step."""
    return all(c.start > 0 and c.samples and c.length == c.num_drafts + 1 for c in chunks)


def scored_rows(chunks: list[ScheduledChunk]) -> tuple[list[int], list[int]]:
    """The rows of the flat batch at each chunk's positions that score a prompt token
    (``ScheduledChunk.scored``, prompt logprobs), and how many of them each chunk has."""
    rows, counts, offset = [], [], 0
    for chunk in chunks:
        scored = chunk.scored
        rows.extend(range(offset + scored.start - chunk.start, offset + scored.stop - chunk.start))
        counts.append(len(scored))
        offset += chunk.length
    return rows, counts
