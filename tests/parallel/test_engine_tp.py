"""``LLM(tensor_parallel_size=2)`` on CPU (gloo) against one process: the same greedy tokens through the
engine with chunked prefill, identical caches on both ranks, and a dead worker reported by rank."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from engine.llm import LLM
from engine.request import SamplingParams
from engine.workers import WorkerFailed
from model.tiny import cached_tiny

# The long prompt spans three chunks of 16 tokens; the two requests share steps.
PROMPTS = [list(range(2, 42)), [0, 911, 37, 5]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE = {"max_num_batched_tokens": 16, "max_model_len": 128, "kv_cache_memory": 4 * 2**20}


@pytest.fixture(autouse=True)
def one_thread():
    """Both ranks on one thread each: two cores, and the same thread count on every rank."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tokens(llm: LLM) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_tp2_engine_matches_one_process_and_reports_a_dead_worker(arch: str):
    """Greedy tokens equal to one process's, equal caches on both ranks; then a killed worker makes the
    next step fail naming its rank."""
    path = cached_tiny(arch)
    single = _tokens(LLM(model=path, enable_prefix_caching=False, **ENGINE))
    llm = LLM(model=path, tensor_parallel_size=2, **ENGINE)
    try:
        assert _tokens(llm) == single
        rank0, rank1 = llm.engine.runner.replica_checksums()
        assert rank0 == rank1
        assert len(rank0) >= llm.engine.model.cfg.num_hidden_layers  # a window pool per layer at least
        worker = llm.workers.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=10)
        with pytest.raises(WorkerFailed, match="rank 1 exited with code -9"):
            llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)
    finally:
        llm.close()
