"""``LLM(data_parallel_size=2, enable_expert_parallel=True)`` on CPU (gloo) against one process: the same
greedy tokens for requests spread over both ranks (chunked prefill, a rank idling while the other
finishes), every (token, expert) choice computed exactly once over the ranks, and a dead rank named."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.parallel.data_parallel import DataParallelEngine
from engine.parallel.group import WorkerFailed
from engine.request import InvalidRequest, SamplingParams
from model.cache import block_layout, cache_groups
from model.checkpoint import load_model
from model.config import ModelConfig
from model.parallel.modules import DispatchMoE
from model.testing.tiny import cached_tiny
from model.tokenizer import load_tokenizer
from tests.parallel.conftest import kill_worker

# 40, 4 and 30 prompt tokens: chunks of 16; rank 0 gets the first and the last, rank 1 the short one.
PROMPTS = [list(range(2, 42)), [0, 911, 37, 5], list(range(100, 130))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE = {"max_num_batched_tokens": 16, "max_model_len": 128, "block_size": 16}


def _tokens(llm: LLM) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_dp2_with_expert_parallel_matches_one_process_and_computes_each_choice_once(arch: str):
    path = cached_tiny(arch)
    single = _tokens(LLM(model=path, enable_prefix_caching=False, **ENGINE))
    llm = LLM(model=path, data_parallel_size=2, enable_expert_parallel=True, **ENGINE)
    try:
        vocab = llm.engine.model.cfg.vocab_size
        with pytest.raises(InvalidRequest, match=f"token id {vocab} is outside the vocabulary"):
            llm.engine.add_request([5, vocab], GREEDY)  # refused by the front, whichever rank it would go to
        assert _tokens(llm) == single
        reports = llm.engine.reports()
        assert all(r.expert_pairs > 0 for r in reports), "both ranks' experts computed"
        assert reports[0].checksums != reports[1].checksums, "each rank's cache holds its own requests"
        # A request's forwarded tokens: its prompt and every output token but the last sampled one; each
        # goes through every backbone MoE block (the draft layers do not run).
        tokens = sum(len(p) + GREEDY.max_tokens - 1 for p in PROMPTS)
        choices = sum(m.gate.top_k for m in llm.engine.model.layers.modules() if isinstance(m, DispatchMoE))
        assert sum(r.expert_pairs for r in reports) == tokens * choices
        kill_worker(llm)
        with pytest.raises(WorkerFailed, match="data-parallel rank 1 exited with code -9"):
            llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)
    finally:
        llm.close()


def test_data_parallel_needs_expert_parallel_and_no_tensor_parallel():
    with pytest.raises(ValueError, match="data_parallel_size=2 runs with enable_expert_parallel=True"):
        LLM(model=cached_tiny("v4"), data_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size=1 for now .got True and 2"):
        LLM(cached_tiny("v4"), data_parallel_size=2, enable_expert_parallel=True, tensor_parallel_size=2)


def test_a_request_on_another_rank_refuses_a_logits_processor():
    """It could not travel to that rank: refused before it is queued, not silently dropped. The front
    needs no worker until it steps: rank 0's engine alone, over two ranks."""
    path = cached_tiny("v4")
    local = LLMEngine(load_model(path), load_tokenizer(path), EngineConfig(**ENGINE))
    front = DataParallelEngine(local, SimpleNamespace(world=2))

    def processor(tokens: list[int], logits: torch.Tensor) -> torch.Tensor:
        return logits

    assert front.add_request([1, 2], GREEDY, logits_processor=processor).logits_processor is processor
    with pytest.raises(InvalidRequest, match="do not run under data parallel yet"):
        front.add_request([1, 2], GREEDY, logits_processor=processor)  # rank 1's turn
    assert not front.plan.admitted and not front.shadows
    assert front.add_request([1, 2], GREEDY).id == front.plan.admitted[1][0].id


@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_dp2_speculating_preempting_ranks_give_the_tokens_of_one_process_and_aborts_reach_rank_1(arch: str):
    """A KV cache of a few blocks per rank (on V4 rank 0 preempts and recomputes one of its two requests),
    and every rank drafts (MTP chaining two drafts on V4, DSpark on V4.1; a rank that drafts less idles
    through the others' draft forwards). Then rank 1's requests are aborted, before and after they reach
    it."""
    path, blocks = cached_tiny(arch), 6
    block_bytes, _ = block_layout(cache_groups(ModelConfig.from_file(path), 4), ENGINE["block_size"])
    engine = {**ENGINE, "kv_cache_memory": blocks * block_bytes}
    single = _tokens(LLM(model=path, enable_prefix_caching=False, **ENGINE))
    engine["speculative_config"] = (
        {"method": "mtp", "num_speculative_tokens": 2} if arch == "v4" else {"method": "dspark"}
    )
    llm = LLM(model=path, data_parallel_size=2, enable_expert_parallel=True, **engine)
    try:
        assert _tokens(llm) == single
        stats = llm.engine.stats()  # rank 0's
        assert stats.preemptions > 0 or arch == "v41"  # V4.1's 6 blocks hold both requests
        assert stats.spec_decode.drafted > 0
        _abort_on_rank_1(llm.engine)
    finally:
        llm.close()


def _abort_on_rank_1(engine) -> None:
    requests = [engine.add_request(p, GREEDY) for p in PROMPTS[1:]]  # one on each rank
    unsent, first = sorted(requests, key=lambda r: r.id not in engine.shadows)  # rank 1's, rank 0's
    engine.abort(unsent.id)
    assert not engine.plan.admitted.get(1), "an unsent request never reaches its rank"
    engine.step()
    running = engine.add_request(PROMPTS[1], GREEDY)  # rank 1, the less loaded
    engine.step()
    engine.abort(running.id)  # aborted on rank 1 at the next step
    while engine.has_work:
        engine.step()
    assert unsent.finish_reason.value == running.finish_reason.value == "abort"
    assert first.finish_reason.value == "length" and len(first.output) == GREEDY.max_tokens
    assert engine.completion(running).finish_reason == "abort"
