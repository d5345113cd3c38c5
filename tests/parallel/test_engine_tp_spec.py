"""Speculative decoding and prefix caching under ``LLM(tensor_parallel_size=2)`` on CPU (gloo): the greedy
tokens of one process that neither drafts nor caches, the same drafts accepted as one process that does,
a second request sharing a prompt prefix resumed from the cache, and identical caches on both ranks; with
drafts that are partly right, the workers keep the accepted ones as rank 0 does."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.factory import build_engine
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.parallel.processes import load_ranks
from engine.request import Request, SamplingParams
from engine.spec_decode.proposer import ScriptedProposer
from model.testing.tiny import cached_tiny
from model.tokenizer import load_tokenizer

# The smallest page each tiny model allows, and its draft head (MTP chaining two drafts: one is fed back).
PAGE = {"v4": 128, "v41": 32}
SPECULATIVE = {"v4": {"method": "mtp", "num_speculative_tokens": 2}, "v41": {"method": "dspark"}}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ENGINE = {"max_num_batched_tokens": 16, "max_model_len": 256, "block_size": 16, "kv_cache_memory": 4 * 2**20}


def _prompts(arch: str) -> tuple[list[list[int]], list[int]]:
    """Two prompts decoded together (the longer one past a page boundary), then one sharing the first
    page and a few tokens with the long one."""
    page = PAGE[arch]
    tokens = torch.randint(3, 1000, (page + 20,), generator=torch.Generator().manual_seed(7)).tolist()
    return [tokens, [0, 911, 37, 5]], tokens[: page + 3] + [17, 29, 3]


def _run(engine: LLMEngine, prompts: list[list[int]]) -> list[Request]:
    requests = [engine.add_request(p, GREEDY) for p in prompts]
    while engine.has_work:
        engine.step()
    return requests


def _outputs(engine: LLMEngine, arch: str) -> tuple[list[list[int]], int | None]:
    """Every request's tokens, and how many prompt tokens the prefix cache gave the last one."""
    together, shared = _prompts(arch)
    requests = _run(engine, together) + _run(engine, [shared])
    return [list(r.output) for r in requests], requests[-1].num_cached


@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_tp2_speculating_with_prefix_caching_matches_one_process(arch: str):
    path = cached_tiny(arch)
    plain, _ = _outputs(LLM(model=path, enable_prefix_caching=False, **ENGINE).engine, arch)
    config = {"speculative_config": SPECULATIVE[arch], "prefix_page_size": PAGE[arch], **ENGINE}
    one = LLM(model=path, **config).engine
    one_tokens, one_hit = _outputs(one, arch)
    llm = LLM(model=path, tensor_parallel_size=2, **config)
    try:
        tokens, hit = _outputs(llm.engine, arch)
        assert tokens == one_tokens == plain
        assert hit == one_hit == PAGE[arch]
        stats, one_stats = llm.engine.spec_stats, one.spec_stats
        assert stats.drafted > stats.accepted  # drafts were verified and rolled back
        assert (stats.drafted_at, stats.accepted_at) == (one_stats.drafted_at, one_stats.accepted_at), stats
        rank0, rank1 = (report.checksums for report in llm.engine.runner.reports())
        assert rank0 == rank1
    finally:
        llm.close()


def test_tp2_workers_keep_the_drafts_rank_0_accepts():
    """The tiny draft heads are random and never right: here two of every three drafts are the greedy
    tokens, so verification keeps several tokens of a chunk, on rank 0 and on the worker alike."""
    path = cached_tiny("v41")
    plain, _ = _outputs(LLM(model=path, enable_prefix_caching=False, **ENGINE).engine, "v41")
    together, shared = _prompts("v41")
    greedy = {tuple(p): out for p, out in zip([*together, shared], plain, strict=True)}

    def two_right(request: Request, k: int) -> list[int]:
        return greedy[tuple(request.prompt)][len(request.output) :][:2] + [0] * (k - 2)

    config = EngineConfig(tensor_parallel_size=2, num_speculative_tokens=3, **ENGINE)
    model, workers = load_ranks(path, torch.float32, torch.device("cpu"), config)
    try:
        engine = build_engine(model, load_tokenizer(path), config, workers, ScriptedProposer(two_right))
        assert _outputs(engine, "v41")[0] == plain
        assert engine.spec_stats.accepted_at[:2] == engine.spec_stats.drafted_at[:2]
        assert engine.spec_stats.accepted_at[2] == 0 < engine.spec_stats.drafted_at[2]
        rank0, rank1 = (report.checksums for report in engine.runner.reports())
        assert rank0 == rank1
    finally:
        workers.close()
