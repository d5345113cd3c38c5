"""``LLM(tensor_parallel_size=2)`` on CPU (gloo) against one process: the same greedy tokens through the
engine with chunked prefill, identical caches on both ranks, and a dead worker reported by rank."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.parallel.group import WorkerFailed
from engine.request import InvalidRequest, SamplingParams
from model.cache import block_layout, cache_groups
from model.config import ModelConfig
from model.testing.tiny import cached_tiny
from tests.parallel.conftest import kill_worker

# Prompts of 40 and 30 tokens span several chunks of 16; the requests share steps, and a cache of a few
# blocks makes the scheduler preempt (and later recompute) some of them.
PROMPTS = [list(range(2, 42)), [0, 911, 37, 5], list(range(100, 130))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)  # the issue asks 32 per prompt
CACHE_BLOCKS = {"v4": 8, "v41": 6}


def _engine(arch: str) -> dict:
    block_bytes, _ = block_layout(cache_groups(ModelConfig.from_file(cached_tiny(arch)), 4), 16)  # fp32
    kv = CACHE_BLOCKS[arch] * block_bytes
    return {"max_num_batched_tokens": 16, "max_model_len": 128, "block_size": 16, "kv_cache_memory": kv}


def _tokens(llm: LLM) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_tp2_engine_matches_one_process_and_reports_a_dead_worker(arch: str):
    """Greedy tokens equal to one process's through chunked prefill and preemption, equal caches on both
    ranks; then a killed worker makes the next step fail naming its rank."""
    path = cached_tiny(arch)
    one = LLM(model=path, enable_prefix_caching=False, **_engine(arch))
    single = _tokens(one)
    llm = LLM(model=path, tensor_parallel_size=2, **_engine(arch))
    try:
        vocab = llm.engine.model.cfg.vocab_size
        with pytest.raises(InvalidRequest, match=f"token id {vocab} is outside the vocabulary"):
            llm.engine.add_request([5, vocab], GREEDY)  # on rank 0, before any step reaches a worker
        assert _tokens(llm) == single
        assert llm.engine.scheduler.preemptions == one.engine.scheduler.preemptions > 0
        rank0, rank1 = (report.checksums for report in llm.engine.runner.reports())
        assert rank0 == rank1
        assert len(rank0) >= llm.engine.model.cfg.num_hidden_layers  # a window pool per layer at least
        kill_worker(llm)
        with pytest.raises(WorkerFailed, match="rank 1 exited with code -9"):
            llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)
    finally:
        llm.close()
