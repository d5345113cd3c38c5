"""Workers that fail never leave rank 0 hanging: a worker that dies before joining, fails to load or stops
answering is reported by rank."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from engine.config import EngineConfig
from engine.workers import RankReport, WorkerFailed, Workers, WorkerSpec
from model.tiny import cached_tiny

CONFIG = EngineConfig(tensor_parallel_size=2, enable_prefix_caching=False, kv_cache_memory=2**20)


def _spec(**fields) -> WorkerSpec:
    return WorkerSpec(str(cached_tiny("v41")), torch.float32, "cpu", CONFIG, **fields)


def test_a_worker_that_dies_before_joining_fails_the_start_naming_it():
    with pytest.raises(WorkerFailed, match="tensor-parallel rank 1 exited with code 1"):
        Workers(2, _spec(threads=0))  # the worker's torch.set_num_threads(0) raises before it joins


def test_a_worker_that_cannot_load_is_reported_with_its_error():
    workers = Workers(2, _spec(quantization="int3"))
    with pytest.raises(ValueError, match=r"tensor-parallel rank 1: ValueError: quantization='int3'"):
        workers.ready()
    assert workers.closed


def test_a_worker_that_stops_answering_fails_the_step_after_the_timeout():
    workers = Workers(2, _spec(timeout_s=5.0))  # also bounds the load before ready()
    (worker,) = workers.processes
    try:
        workers.ready()
        os.kill(worker.pid, signal.SIGSTOP)
        with pytest.raises(WorkerFailed, match=r"a step with tensor-parallel rank\(s\) 1 failed"):
            workers.reports(RankReport(0, 0, {}))
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        workers.close()
    assert not worker.is_alive()
