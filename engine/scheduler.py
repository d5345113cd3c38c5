"""One token budget per step, shared by decodes and prefill chunks; FCFS with preemption.

Running requests are served first (oldest first): a decode takes one token, a prefill the next
chunk that fits the budget. Waiting requests are admitted in arrival order while seats, budget
and cache blocks last. When a running request cannot get its blocks, the newest running request
is preempted (its cache freed, to be recomputed later), so the oldest always progresses.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.kv_cache import KVCacheManager
from engine.request import FinishReason, Request, Status


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # first position computed in this step
    length: int  # tokens computed in this step

    @property
    def samples(self) -> bool:
        """The chunk reaches the request's last known token: the step produces the next one."""
        return self.start + self.length == self.request.num_tokens


class Scheduler:
    def __init__(self, cache: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_seqs={max_num_seqs}, max_num_batched_tokens={max_num_batched_tokens}: must be > 0"
            )
        self.cache = cache
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0

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
            while not self.cache.allocate(request.id, chunk.start, chunk.start + chunk.length):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    break
            else:
                chunks.append(chunk)
                budget -= chunk.length
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            chunk = self._chunk(request, budget)
            if not self.cache.allocate(request.id, chunk.start, chunk.start + chunk.length):
                break
            self.waiting.popleft()
            request.status = Status.RUNNING
            self.running.append(request)
            chunks.append(chunk)
            budget -= chunk.length
        return chunks

    def _chunk(self, request: Request, budget: int) -> ScheduledChunk:
        start = request.num_computed
        return ScheduledChunk(request, start, min(request.num_tokens - start, budget))

    def _preempt(self, request: Request) -> None:
        self.cache.free_request(request.id)
        self.running.remove(request)
        request.status, request.num_computed = Status.WAITING, 0
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
