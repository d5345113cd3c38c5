"""The engine over a quantised KV cache (``kv_cache_dtype="int8"``): speculative rollback and the start-up
checks behave as over the compute-dtype cache, since a row's codes depend on that row alone
(``triton_kernels.kv_store``); prefix hits and preemption over it are tested with the prefix cache's
tests (``test_prefix_cache_engine``)."""

from __future__ import annotations

import pytest
import torch

from engine.config import KV_CACHE_DTYPES, EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.server.args import engine_config, parse_args
from model import cache
from model.cache import check_kv_cache_device
from model.testing.tiny import cached_tiny
from tests.engine import test_prefix_cache_engine as prefix
from tests.engine import test_spec_decode as spec
from tests.engine.test_prefix_cache_engine import random_tokens

tiny = prefix.tiny  # its fixture: the tiny V4 and V4.1 models


def engine(tiny, **config) -> LLMEngine:
    return prefix.engine(tiny, **{"kv_cache_dtype": "int8", **config})


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


def test_rejected_drafts_roll_back_exactly(tiny):
    """The target's own greedy tokens as drafts, made wrong on the tokens that close a compressor window
    (the entry the call stored must vanish): the greedy tokens of plain decoding."""
    arch, model, tokenizer = tiny
    prompts = [random_tokens(model, 50, seed=4)]
    plain, _ = spec.run(spec.engine(tiny, k=None, kv_cache_dtype="int8"), prompts, spec.GREEDY)
    ratio = 2 if arch == "v41" else 4
    proposer = spec.scripted({tuple(prompts[0]): plain[0]}, lambda request, pos: (pos + 1) % ratio == 0)
    drafted = spec.engine(tiny, proposer, kv_cache_dtype="int8")
    out, _ = spec.run(drafted, prompts, spec.GREEDY)
    assert 0 < drafted.spec_stats.accepted < drafted.spec_stats.drafted
    assert out == plain


def test_the_server_flag_sets_the_cache_dtype() -> None:
    assert engine_config(parse_args(["--kv-cache-dtype", "int8"])).kv_cache_dtype == "int8"
    assert engine_config(parse_args([])).kv_cache_dtype == "auto"


def test_llm_takes_the_cache_dtype() -> None:
    llm = LLM(model=cached_tiny("v4"), kv_cache_dtype="int8", max_model_len=256)
    assert llm.engine.runner.pools.layout.kv_cache_dtype == "int8"
    assert llm.engine.cache.groups[0].kv_cache_dtype == "int8"
