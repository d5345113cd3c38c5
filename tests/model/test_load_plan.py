"""The start-up memory plan: weight bytes from the headers equal what the loader then holds, the KV cache
gets the rest of the budget, and a plan that cannot hold one request is refused naming the numbers."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.memory_plan import activation_bytes, plan_memory
from model.cache import CacheLayout
from model.checkpoint import load_model
from model.config import ModelConfig
from model.testing.tiny import write_tiny

SHAPE = {"max_num_batched_tokens": 256, "max_model_len": 1024, "block_size": 16}


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("fp8"), fp8=True)


@pytest.mark.parametrize("quantization", ["auto", "dense", "w8a8"])
def test_weight_bytes_from_the_headers_are_what_loads(fp8_dir, quantization):
    plan = plan_memory(fp8_dir, torch.bfloat16, quantization, kv_cache_memory=2**24, **SHAPE)
    model = load_model(fp8_dir, torch.bfloat16, quantization=quantization)
    assert plan.weight_bytes == sum(t.numel() * t.element_size() for t in model.state_dict().values())


def test_the_kv_cache_gets_what_remains(fp8_dir):
    device = 2**30
    plan = plan_memory(
        fp8_dir, torch.float32, "auto", gpu_memory_utilization=0.5, device_bytes=device, **SHAPE
    )
    assert plan.kv_bytes == device // 2 - plan.weight_bytes - plan.activation_bytes > 0
    model = load_model(fp8_dir)
    cache = KVCacheManager.from_budget(
        CacheLayout.for_model(model.cfg, torch.float32, SHAPE["block_size"]), plan.kv_bytes
    )
    assert plan.num_blocks == cache.num_blocks
    assert plan.max_concurrency == cache.num_blocks / cache.max_blocks(1024, 256)
    assert "maximum concurrency at 1024 tokens per request" in plan.line()


def test_a_plan_that_cannot_hold_one_request_is_refused(fp8_dir):
    with pytest.raises(ValueError, match=r"one request of max_model_len=1024 needs \d+ blocks"):
        plan_memory(fp8_dir, torch.float32, "auto", kv_cache_memory=2**16, **SHAPE)
    with pytest.raises(ValueError, match=r"0.5 x 0.0 GiB less weights and activations; weights 0.0\d+ GiB"):
        plan_memory(fp8_dir, torch.float32, "auto", gpu_memory_utilization=0.5, device_bytes=2**22, **SHAPE)
    with pytest.raises(
        ValueError, match=r"--kv-cache-memory=1099511627776 B .* exceeds the device's 1.0 GiB"
    ):
        plan_memory(fp8_dir, torch.float32, "auto", kv_cache_memory=2**40, device_bytes=2**30, **SHAPE)


def test_max_model_len_auto_is_the_longest_request_the_kv_cache_holds(fp8_dir):
    """vLLM's `--max-model-len auto`: as long as the KV cache holds one request, at most the model's."""
    shape = {**SHAPE, "max_model_len": None}
    cfg = ModelConfig.from_file(fp8_dir)
    small = plan_memory(fp8_dir, torch.float32, "auto", kv_cache_memory=2**21, **shape)
    cache = KVCacheManager(CacheLayout.for_model(cfg, torch.float32, SHAPE["block_size"]), 1)
    chunk = SHAPE["max_num_batched_tokens"]
    assert small.blocks_per_request <= small.num_blocks < cache.max_blocks(small.max_model_len + 1, chunk)
    big = plan_memory(fp8_dir, torch.float32, "auto", kv_cache_memory=2**40, **shape)
    assert big.max_model_len == cfg.max_position_embeddings


def test_the_plan_reserves_the_mtp_drafts_lookahead(fp8_dir):
    """The server plans with the proposer's lookahead (known from the flags alone): a KV cache that holds
    one request exactly is refused once the MTP drafts need positions past it."""
    exact = plan_memory(fp8_dir, torch.float32, "auto", kv_cache_memory=2**24, **SHAPE)
    fits = exact.blocks_per_request * exact.block_bytes
    assert (
        plan_memory(fp8_dir, torch.float32, "auto", kv_cache_memory=fits, **SHAPE).num_blocks
        == fits // exact.block_bytes
    )
    mtp = EngineConfig(speculative_method="mtp", num_speculative_tokens=2)
    assert (mtp.lookahead, EngineConfig(speculative_method="dspark").lookahead, EngineConfig().lookahead) == (
        2,
        0,
        0,
    )
    with pytest.raises(ValueError, match=r"one request of max_model_len=1024 needs \d+ blocks"):
        plan_memory(fp8_dir, torch.float32, "auto", kv_cache_memory=fits, lookahead=mtp.lookahead, **SHAPE)


def test_decode_graphs_take_their_activations_from_the_kv_cache(fp8_dir):
    share = {"gpu_memory_utilization": 0.5, "device_bytes": 2**30, **SHAPE}
    eager = plan_memory(fp8_dir, torch.float32, "auto", **share)
    graphs = plan_memory(fp8_dir, torch.float32, "auto", graph_tokens=64, **share)
    extra = activation_bytes(ModelConfig.from_file(fp8_dir), 64, 4)
    assert graphs.activation_bytes == eager.activation_bytes + extra > eager.activation_bytes
    assert graphs.kv_bytes == eager.kv_bytes - extra
