"""What a quantised KV cache holds: the memory plan counts the quantised bytes of every row (model-spec §9.4),
so the same ``kv_cache_memory`` holds more tokens and more requests."""

from __future__ import annotations

import pytest
import torch

from engine.memory_plan import cache_capacity, plan_memory
from model.cache import row_formats
from model.config import ModelConfig
from model.testing.release_like import like_config
from model.testing.tiny import cached_tiny, toy_config

KV_BYTES = 2**30
CONFIGS = {
    "tiny-v4": lambda: toy_config("v4"),
    "tiny-v41": lambda: toy_config("v41"),
    "v4-flash-widths": lambda: like_config("v4-flash", 8, 16),
}


def _row_ratio(cfg: ModelConfig, dtype_bytes: int, kind: str) -> float:
    """Bytes of one layer's row in the compute dtype over its bytes quantised: what capacity can gain."""
    auto, quantised = (
        next(f for f in row_formats(cfg, dtype_bytes, mode) if f.kind == kind) for mode in ("auto", "int8")
    )
    return auto.nbytes / quantised.nbytes


@pytest.mark.parametrize("name", CONFIGS)
def test_int8_rows_hold_more_tokens_at_the_same_memory(name: str) -> None:
    cfg = ModelConfig.from_dict(CONFIGS[name]())
    for dtype in (torch.float32, torch.bfloat16):
        itemsize = torch.empty(0, dtype=dtype).element_size()
        tokens = {
            mode: cache_capacity(cfg, dtype, mode, KV_BYTES, 16, 1024)[1] for mode in ("auto", "int8", "fp8")
        }
        gain = tokens["int8"] / tokens["auto"]
        print(f"{name} {dtype}: tokens in 1 GiB {tokens}, int8 / auto = {gain:.3f}")
        assert tokens["fp8"] == tokens["int8"]  # one byte per NoPE code either way
        # A long request's tokens cost compressed entries (the window is bounded): the gain is at least the
        # worse of the entry and the index-key row ratios, less a little block padding.
        bound = min(_row_ratio(cfg, itemsize, kind) for kind in ("entries", "index_keys"))
        assert gain >= 0.98 * bound
        if dtype == torch.float32:
            assert gain >= 1.8  # the acceptance floor against fp32 caches
        else:
            # Against bf16 the RoPE dims (kept in bf16) and the scale bound the gain: at V4-Flash widths
            # 1024 / (448 + 128 + 4) = 1.77 per entry, at tiny widths 128 / (48 + 32 + 4) = 1.52.
            assert gain >= 1.5


@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_the_plan_prints_capacity_and_concurrency_per_dtype(arch: str) -> None:
    shape = {"max_num_batched_tokens": 64, "max_model_len": 1024, "block_size": 16, "kv_cache_memory": 2**24}
    plans = {
        mode: plan_memory(cached_tiny(arch), torch.float32, "auto", kv_cache_dtype=mode, **shape)
        for mode in ("auto", "int8")
    }
    for plan in plans.values():
        print(plan.line())
        assert f"{plan.kv_cache_dtype} rows holding {plan.capacity_tokens} tokens" in plan.line()
    auto, int8 = plans["auto"], plans["int8"]
    assert auto.kv_bytes == int8.kv_bytes and int8.block_bytes < auto.block_bytes
    assert int8.capacity_tokens >= 1.8 * auto.capacity_tokens
    assert int8.max_concurrency >= 1.8 * auto.max_concurrency


def test_a_kv_cache_dtype_outside_the_choices_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype='int4' must be one of"):
        row_formats(ModelConfig.from_dict(toy_config("v4")), 4, "int4")
