"""Workers that fail never leave rank 0 hanging: a worker that dies before joining, fails to load or stops
answering is reported by rank."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from engine.config import EngineConfig
from engine.parallel.group import Rendezvous, WorkerFailed, free_port, init_group
from engine.parallel.plans import RankReport, WorkerSpec
from engine.parallel.processes import Workers, _spawn
from model.testing.tiny import cached_tiny

CONFIG = EngineConfig(tensor_parallel_size=2, enable_prefix_caching=False, kv_cache_memory=2**20)


def _spec(**fields) -> WorkerSpec:
    return WorkerSpec(str(cached_tiny("v41")), torch.float32, "cpu", CONFIG, **fields)


def test_rank_0_stops_waiting_when_a_worker_dies_before_joining():
    """What ``Workers`` does while its ranks join: a dead worker ends the wait at once."""
    meet = Rendezvous(port=free_port())
    (worker,) = _spawn([1], 2, meet, "tpu", 60.0)  # no such backend: it exits before it joins

    def watch() -> None:
        if not worker.is_alive():
            raise WorkerFailed(f"tensor-parallel rank 1 exited with code {worker.exitcode}")

    try:
        with pytest.raises(WorkerFailed, match="tensor-parallel rank 1 exited with code 1"):
            init_group(0, 2, meet, "cpu", 60.0, watch)
    finally:
        worker.join(timeout=10)
        if worker.is_alive():
            worker.kill()


def test_a_worker_that_cannot_load_is_reported_with_its_error():
    workers = Workers(2, _spec(quantization="int3"))
    try:
        with pytest.raises(ValueError, match=r"tensor-parallel rank 1: ValueError: quantization='int3'"):
            workers.ready()
        assert workers.closed
    finally:
        workers.close()


def test_a_worker_that_stops_answering_fails_the_step_after_the_timeout():
    workers = Workers(2, _spec(timeout_s=3.0))  # collectives only: the load is watched, not timed
    (worker,) = workers.processes
    try:
        workers.ready()
        os.kill(worker.pid, signal.SIGSTOP)
        with pytest.raises(WorkerFailed, match=r"a step with tensor-parallel rank\(s\) 1 failed"):
            workers.reports(RankReport(0, 0, {}))
        with pytest.raises(WorkerFailed):  # the group is done for: no further step is tried
            workers.reports(RankReport(0, 0, {}))
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        workers.close()
    assert not worker.is_alive()
