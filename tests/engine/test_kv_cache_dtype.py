"""The engine over a quantised KV cache (``kv_cache_dtype="int8"``): prefix hits, preemption, speculative
rollback and the start-up checks behave as over the compute-dtype cache, since a row's codes depend on that
row alone (``triton_kernels.kv_store``)."""

from __future__ import annotations

import pytest
import torch

from engine.config import KV_CACHE_DTYPES, EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from model import cache
from model.cache import check_kv_cache_device
from model.checkpoint import load_model
from model.testing.tiny import cached_tiny
from model.tokenizer import load_tokenizer
from tests.engine.test_prefix_cache_engine import PAGE, cached_blocks, random_tokens, run
from tests.engine.test_spec_decode import scripted


@pytest.fixture(scope="module", params=["v4", "v41"])
def tiny(request):
    path = cached_tiny(request.param)
    return request.param, load_model(path), load_tokenizer(path)


def engine(tiny, **config) -> LLMEngine:
    arch, model, tokenizer = tiny
    config = {
        "prefix_page_size": PAGE[arch],
        "max_num_batched_tokens": 1024,
        "kv_cache_dtype": "int8",
        **config,
    }
    return LLMEngine(model, tokenizer, EngineConfig(**config))


def test_the_engine_config_names_the_cache_dtypes_of_the_model() -> None:
    assert KV_CACHE_DTYPES == cache.KV_CACHE_DTYPES
    with pytest.raises(ValueError, match="kv_cache_dtype='fp16' must be one of"):
        EngineConfig(kv_cache_dtype="fp16")


def test_fp8_is_refused_where_the_device_has_none() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8': the npu device has no FP8"):
        check_kv_cache_device("fp8", "npu")
    check_kv_cache_device("int8", "npu")
    check_kv_cache_device("fp8", torch.device("cuda"))


def test_the_pools_store_int8_rows(tiny) -> None:
    pools = engine(tiny).runner.pools
    window = next(iter(pools.window.values()))
    keys = next(iter(pools.index_keys.values()))
    cfg = tiny[1].cfg
    assert window.data.dtype == torch.int8 and window.data.shape[1] == cfg.head_dim - cfg.qk_rope_head_dim
    assert window.rope.dtype == pools.dtype and window.scale.dtype == torch.float32
    assert keys.data.dtype == torch.int8 and keys.rope is None  # index keys: int8 whole rows


def test_a_hit_gives_the_logits_of_a_cold_run(tiny):
    arch, model, _ = tiny
    page = PAGE[arch]
    shared = random_tokens(model, 2 * page + 40, seed=1)
    warm = engine(tiny)
    run(warm, shared[: 2 * page + 5])
    before = cached_blocks(warm)
    prompt = shared[: 2 * page + 9] + random_tokens(model, 11, seed=2)
    hit_out, hit_logits, hit = run(warm, prompt)
    cold_out, cold_logits, cold_hit = run(engine(tiny), prompt)
    assert (hit, cold_hit) == (2 * page, 0)
    assert hit_out == cold_out
    assert all(torch.equal(a, b) for a, b in zip(hit_logits, cold_logits, strict=True))
    assert all(torch.equal(before[b], warm.runner.pools.buffer[b]) for b in before), "a shared block changed"


def test_a_preempted_request_gives_the_tokens_of_an_uninterrupted_one(tiny):
    arch, model, _ = tiny
    prompt = random_tokens(model, PAGE[arch] + 20, seed=3)
    cold_out, _, _ = run(engine(tiny, enable_prefix_caching=False), prompt, max_tokens=8)
    warm = engine(tiny)
    out, _, _ = run(warm, prompt, max_tokens=8, preempt_after=4)
    assert warm.scheduler.preemptions == 1 and out == cold_out


def test_rejected_drafts_roll_back_exactly(tiny):
    """The target's own greedy tokens as drafts, made wrong on the tokens that close a compressor window
    (the entry the call stored must vanish): the greedy tokens of plain decoding."""
    arch, model, tokenizer = tiny
    prompt = random_tokens(model, 50, seed=4)
    plain, _, _ = run(engine(tiny, enable_prefix_caching=False), prompt, max_tokens=12)
    ratio = 2 if arch == "v41" else 4
    proposer = scripted({tuple(prompt): plain}, lambda request, pos: (pos + 1) % ratio == 0)
    config = EngineConfig(max_num_batched_tokens=96, num_speculative_tokens=3, kv_cache_dtype="int8")
    drafted = LLMEngine(model, tokenizer, config, proposer)
    out, _, _ = run(drafted, prompt, max_tokens=12)
    assert 0 < drafted.spec_stats.accepted < drafted.spec_stats.drafted
    assert out == plain


def test_llm_takes_the_cache_dtype() -> None:
    llm = LLM(model=cached_tiny("v4"), kv_cache_dtype="int8", max_model_len=256)
    assert llm.engine.runner.pools.layout.kv_cache_dtype == "int8"
    assert llm.engine.cache.groups[0].kv_cache_dtype == "int8"
