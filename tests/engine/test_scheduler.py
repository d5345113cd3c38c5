"""Scheduling: the token budget, seats, chunked prefill, preemption and no starvation."""

from __future__ import annotations

import random

from engine.kv_cache import KVCacheManager
from engine.request import FinishReason, Request, SamplingParams, Status
from engine.scheduler import Scheduler
from model.cache import CacheGroup, CacheLayout

GROUPS = (CacheGroup("window", 1, 64, window=8), CacheGroup("compressed_r2", 2, 64))


def scheduler(blocks: int = 64, seqs: int = 4, budget: int = 16) -> Scheduler:
    return Scheduler(KVCacheManager(CacheLayout.of(GROUPS, 4), blocks), seqs, budget)


def advance(s: Scheduler, chunks) -> None:
    """What the engine does after running a step: commit the tokens, sample one where due."""
    for c in chunks:
        c.request.num_computed = c.start + c.length
        s.cache.release_old(c.request.id, c.request.num_computed)
        if c.samples:
            c.request.output.append(7)
            if len(c.request.output) >= c.request.params.max_tokens:
                s.finish(c.request, FinishReason.LENGTH)


def test_budget_and_seats_are_respected_and_prefill_is_chunked():
    s = scheduler(seqs=2, budget=10)
    reqs = [Request(list(range(1, n)), SamplingParams(max_tokens=3)) for n in (25, 4, 9)]
    for r in reqs:
        s.add(r)
    chunks = s.schedule()
    assert [(c.request, c.start, c.length) for c in chunks] == [(reqs[0], 0, 10)]
    advance(s, chunks)
    chunks = s.schedule()
    assert sum(c.length for c in chunks) <= 10 and len(s.running) <= 2
    assert chunks[0].request is reqs[0] and chunks[0].start == 10


def test_preemption_frees_the_newest_and_everyone_finishes():
    s = scheduler(blocks=12, seqs=8, budget=8)
    reqs = [Request(list(range(1, 30)), SamplingParams(max_tokens=6)) for _ in range(5)]
    for r in reqs:
        s.add(r)
    steps = 0
    first_done = {}
    while s.has_work:
        chunks = s.schedule()
        assert chunks, "no progress"
        assert sum(c.length for c in chunks) <= 8
        advance(s, chunks)
        steps += 1
        for r in reqs:
            if r.finished:
                first_done.setdefault(r.id, steps)
        assert steps < 500
    assert s.preemptions > 0
    assert all(r.status is Status.FINISHED and len(r.output) == 6 for r in reqs)
    order = [first_done[r.id] for r in reqs]
    assert order == sorted(order)  # FCFS: the oldest is never starved by newer ones
    assert s.cache.num_free == 12


def test_random_workloads_never_starve_or_leak():
    rng = random.Random(1)
    for _ in range(20):
        s = scheduler(blocks=rng.randint(10, 30), seqs=rng.randint(1, 6), budget=rng.randint(1, 24))
        reqs = [
            Request([1] * rng.randint(1, 40), SamplingParams(max_tokens=rng.randint(1, 8))) for _ in range(8)
        ]
        for r in reqs:
            s.add(r)
        for _ in range(2000):
            if not s.has_work:
                break
            advance(s, s.schedule())
        assert not s.has_work and all(r.finished for r in reqs)
        assert s.cache.num_free == s.cache.num_blocks


def test_abort_of_waiting_and_running_requests_frees_blocks():
    s = scheduler()
    a, b = Request([1] * 10, SamplingParams()), Request([1] * 10, SamplingParams())
    s.add(a)
    s.add(b)
    s.schedule()
    s.finish(a, FinishReason.ABORT)
    s.finish(b, FinishReason.ABORT)
    assert not s.has_work and s.cache.num_free == 64 and a.finish_reason is FinishReason.ABORT
