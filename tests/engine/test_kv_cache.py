"""Block accounting: all-or-nothing allocation, sliding-window release, capacity, no leaks."""

from __future__ import annotations

import random

import pytest

from engine.kv_cache import KVCacheManager
from model.cache import CacheGroup, CacheLayout, cache_groups
from model.config import ModelConfig
from model.testing.tiny import TOY_V4

GROUPS = (
    CacheGroup("window", 1, 64, window=8),
    CacheGroup("compressed_r4", 4, 32),
)


def manager(num_blocks: int = 32) -> KVCacheManager:
    return KVCacheManager(CacheLayout.of(GROUPS, 4), num_blocks)


def test_groups_of_the_toy_v4():
    groups = cache_groups(ModelConfig.from_dict({**TOY_V4, "vocab_size": 4096}), 4)
    assert [g.name for g in groups] == ["window", "compressed_r4", "compressed_r128"]
    assert groups[0].window == 32 and groups[0].bytes_per_slot == 7 * 64 * 4  # 6 layers + the MTP layer
    assert groups[1].bytes_per_slot == 2 * (64 + 32) * 4  # two CSA layers: main KV + index keys
    assert groups[2].bytes_per_slot == 2 * 64 * 4


def test_slots_per_block_equalise_page_bytes():
    cache = manager()
    assert cache.slots_per_block == {"window": 4, "compressed_r4": 8}


def test_allocation_is_all_or_nothing():
    cache = manager(num_blocks=3)
    assert cache.blocks_needed("a", 0, 13) == 4 + 1  # 4 window blocks, 3 entries in one block
    assert not cache.allocate("a", 0, 13)
    assert cache.num_free == 3 and "a" not in cache.tables
    assert cache.allocate("a", 0, 8)
    assert cache.num_free == 0
    assert cache.usage() == {"window": 2, "compressed_r4": 1}


def test_window_blocks_are_released_once_out_of_reach():
    cache = manager()
    assert cache.allocate("a", 0, 20)
    cache.release_old("a", 20)  # positions < 13 are unreachable: blocks 0..2 (positions 0..11)
    assert cache.tables["a"]["window"].blocks[:3] == [-1, -1, -1]
    assert cache.usage()["window"] == 2
    assert cache.allocate("a", 20, 21)  # decode: one more position, same blocks
    assert cache.blocks_needed("a", 21, 30) == 2


def test_a_long_chunk_skips_blocks_it_never_needs():
    cache = manager()
    assert cache.allocate("a", 0, 4)
    cache.release_old("a", 4)
    assert cache.allocate("a", 40, 44)  # a jump: only positions 33.. are read by this step
    window = cache.tables["a"]["window"].blocks
    assert window[1:8] == [-1] * 7 and all(b >= 0 for b in window[8:11])
    cache.release_old("a", 44)
    assert window[:9] == [-1] * 9 and cache.usage()["window"] == 2


def test_max_blocks_bounds_the_peak():
    cache = manager(num_blocks=1000)
    for length in (1, 7, 100, 257):
        start = 0
        peak = 0
        while start < length:
            end = min(length, start + 16)
            assert cache.allocate("r", start, end)
            peak = max(peak, sum(cache.usage().values()))
            cache.release_old("r", end)
            start = end
        assert peak <= cache.max_blocks(length, 16)
        cache.free_request("r")


def test_no_leaks_after_many_random_lifecycles():
    rng = random.Random(0)
    cache = manager(num_blocks=40)
    live: dict[str, int] = {}
    for i in range(1000):
        if live and rng.random() < 0.4:
            rid = rng.choice(sorted(live))
            cache.free_request(rid)
            del live[rid]
            continue
        rid = f"r{i}"
        start = 0
        end = rng.randint(1, 40)
        while cache.allocate(rid, start, end):
            cache.release_old(rid, end)
            live[rid] = end
            start, end = end, end + rng.randint(1, 9)
            if end > 80:
                break
        held = sum(sum(1 for b in t.blocks if b >= 0) for ts in cache.tables.values() for t in ts.values())
        assert held + cache.num_free == 40
        assert len(set(cache.free)) == len(cache.free)
    for rid in list(cache.tables):
        cache.free_request(rid)
    assert cache.num_free == 40 and sorted(cache.free) == list(range(40))


def test_budget_below_one_block_is_an_error():
    with pytest.raises(ValueError, match="below one block"):
        KVCacheManager.from_budget(CacheLayout.of(GROUPS, 4), 100)
