"""One token budget per step, shared by decodes and prefill chunks; FCFS with preemption.

Running requests are served first (oldest first): a decode takes one token (plus the drafts it
verifies, when speculating), a prefill the next chunk that fits the budget. Waiting requests are
admitted in arrival order while seats, budget and cache blocks last. When a running request cannot
get its blocks, the newest running request is preempted (its cache freed, to be recomputed later),
so the oldest always progresses.

With a prefix cache, a request starting (again) first takes the longest cached prefix of its tokens
and computes from there (unless it still needs prompt logprobs: those positions must be computed).
Its computation stops on the page boundaries the cache checkpoints, so that the engine can save the
state there: a prefill chunk ends at the last page boundary before the request's last known token,
and a speculative step never verifies drafts past the next boundary.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from engine.kv_cache import KVCacheManager
from engine.request import FinishReason, Request, Status


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # first position computed in this step
    length: int  # tokens computed in this step, drafts included
    num_drafts: int = 0  # the last ones are the request's first draft tokens, to verify

    @property
    def samples(self) -> bool:
        """The chunk reaches the request's last known token: the step produces the next one(s)."""
        return self.start + self.length - self.num_drafts == self.request.num_tokens

    @property
    def scored(self) -> range:
        """The positions of this chunk whose logits score the next prompt token (``engine.prompt_logprobs``):
        those of a request asking for prompt logprobs not scored before (a preempted request's were)."""
        request = self.request
        if request.params.prompt_logprobs is None:
            return range(0)
        return range(
            max(self.start, len(request.prompt_logprobs)),
            min(self.start + self.length, len(request.prompt) - 1),
        )

    @property
    def token_ids(self) -> list[int]:
        known = self.request.tokens[self.start : self.start + self.length - self.num_drafts]
        proposal = self.request.proposal
        return known + (proposal.tokens[: self.num_drafts] if proposal else [])


class Scheduler:
    def __init__(
        self, cache: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, lookahead: int = 0
    ):
        """``lookahead``: positions past a sampling chunk whose KV the drafting after it writes."""
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_seqs={max_num_seqs}, max_num_batched_tokens={max_num_batched_tokens}: must be > 0"
            )
        self.cache, self.lookahead = cache, lookahead
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, the tokens found

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget, chunks = self.max_num_batched_tokens, []
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            chunk = self._chunk(request, budget)
            while not self._allocate(chunk):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    break
            else:
                chunks.append(chunk)
                budget -= chunk.length
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            # A hit would skip the logits of the cached positions that prompt logprobs still need.
            looks_up = request.num_computed == 0 and not request.scoring_prompt
            hit = self.cache.attach_prefix(request.id, request.tokens) if looks_up else 0
            request.num_computed = hit
            chunk = self._chunk(request, budget)
            if not self._allocate(chunk):
                self.cache.free_request(request.id)
                request.num_computed = 0
                break
            if self.cache.prefix is not None:
                self.prefix_queries += request.num_tokens
                self.prefix_hits += hit
            if request.num_cached is None:
                request.num_cached = hit
            self.waiting.popleft()
            request.status = Status.RUNNING
            if request.scheduled_at is None:
                request.scheduled_at = time.monotonic()
            self.running.append(request)
            chunks.append(chunk)
            budget -= chunk.length
        return chunks

    def _chunk(self, request: Request, budget: int) -> ScheduledChunk:
        start = request.num_computed
        known = request.num_tokens - start
        drafts = len(request.proposal.tokens) if request.proposal and known == 1 else 0
        length = min(known + drafts, budget, self._to_boundary(request, start))
        return ScheduledChunk(request, start, length, max(0, length - known))

    def _to_boundary(self, request: Request, start: int) -> int:
        """The most tokens a step may compute from ``start`` without passing a checkpoint boundary."""
        if self.cache.prefix is None:
            return request.num_tokens
        page = self.cache.prefix.page_size
        last = (request.num_tokens - 1) // page * page  # the last boundary before the last known token
        if start < last:
            return last - start
        return (start // page + 1) * page - start

    def _allocate(self, chunk: ScheduledChunk) -> bool:
        end = chunk.start + chunk.length + (self.lookahead if chunk.samples else 0)
        return self.cache.allocate(chunk.request.id, chunk.start, end)

    def _preempt(self, request: Request) -> None:
        self.cache.free_request(request.id)
        self.running.remove(request)
        request.status, request.num_computed, request.proposal = Status.WAITING, 0, None
        self.waiting.appendleft(request)
        self.preemptions += 1

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Mark finished (or aborted) and give its blocks back, wherever it is."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.cache.free_request(request.id)
        request.status, request.finish_reason = Status.FINISHED, reason
