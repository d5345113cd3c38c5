"""The prefix cache on its own and in the block manager: chained keys, longest checkpointed run,
reference counts, copies of the block a boundary falls inside, LRU eviction, no leaks."""

from __future__ import annotations

import random

import pytest

from engine.kv_cache import KVCacheManager
from engine.prefix_cache import Checkpoint, PrefixCache, cache_salt, check_page_size
from model.cache import CacheGroup, CacheLayout

P = 16
GROUPS = (
    CacheGroup("window", 1, 64, window=8),
    CacheGroup("compressed_r4", 4, 32),
    CacheGroup("compressed_r16", 16, 32),
)


def manager(num_blocks: int = 64) -> KVCacheManager:
    return KVCacheManager(CacheLayout.of(GROUPS, 4), num_blocks, PrefixCache(P, cache_salt("m")))


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def chain(cache: PrefixCache, prompt: list[int], checkpoints: set[int]) -> None:
    parent = None
    for key in cache.keys(prompt):
        parent = cache.get(key) or cache.insert(key, parent, {})
        if parent.end in checkpoints:
            parent.checkpoint = Checkpoint(0, [], parent.end)


def test_page_size_must_close_every_window():
    check_page_size(256, (0, 4, 128), 128)
    check_page_size(32, (0, 2, 1), 32)
    for size, ratios, window in [(192, (4, 128), 128), (64, (4, 128), 32), (16, (2,), 32), (0, (2,), 0)]:
        with pytest.raises(ValueError, match=f"page size {size} must be a multiple"):
            check_page_size(size, ratios, window)


def test_keys_chain_the_whole_prefix_and_the_salt():
    cache = PrefixCache(P, cache_salt("model", "float32"))
    a, b = tokens(3 * P + 5), tokens(3 * P + 5)
    assert len(cache.keys(a)) == 3 and cache.keys(a) == cache.keys(b)
    b[P + 3] += 1  # a change in page 1 changes the key of every page from there on
    assert cache.keys(b)[0] == cache.keys(a)[0] and set(cache.keys(b)[1:]).isdisjoint(cache.keys(a))
    other = PrefixCache(P, cache_salt("model", "bfloat16"))
    assert set(other.keys(a)).isdisjoint(cache.keys(a))


def test_lookup_is_the_longest_run_cut_back_to_a_checkpoint_below_the_last_token():
    cache = PrefixCache(P, b"")
    prompt = tokens(5 * P)
    chain(cache, prompt, {P, 3 * P, 5 * P})
    assert cache.lookup(prompt + [1]).num_tokens == 5 * P
    assert cache.lookup(prompt).num_tokens == 3 * P  # 5P would leave no token to compute
    assert cache.lookup(prompt[: 3 * P]).num_tokens == P
    assert cache.lookup(prompt[: P + 1]).num_tokens == P
    assert cache.lookup(prompt[:P]).num_tokens == 0
    diverged = list(prompt)
    diverged[2 * P] += 1
    assert cache.lookup(diverged).num_tokens == P
    diverged[0] += 1
    assert cache.lookup(diverged).num_tokens == 0


def test_eviction_is_lru_leaves_first_and_spares_pages_in_use():
    cache = PrefixCache(P, b"")
    a, b = tokens(2 * P, seed=1), tokens(2 * P, seed=2)
    chain(cache, a, {2 * P})
    chain(cache, b, {2 * P})
    hit = cache.lookup(a + [0])
    cache.acquire(hit.pages)
    assert cache.lookup(b + [0]).num_tokens == 2 * P  # b is now the more recent, but a is in use
    first_b, second_b = (cache.get(k) for k in cache.keys(b))
    assert cache.evict() is not None and cache.get(second_b.key) is None  # the leaf before its parent
    assert cache.evict() is not None and cache.get(first_b.key) is None
    assert cache.evict() is None  # only pages in use are left
    cache.release(hit.pages)
    assert cache.evict() is not None and cache.evict() is not None and cache.num_pages() == 0


def test_a_hit_shares_full_blocks_and_copies_the_block_the_boundary_cuts():
    cache = manager()
    prompt = tokens(2 * P + 3)
    assert cache.allocate("a", 0, 2 * P)
    cache.register("a", prompt[: 2 * P], state="at 2P")
    table_a = {name: list(t.blocks) for name, t in cache.tables["a"].items()}
    cache.free_request("a")
    assert cache.num_free == cache.num_blocks  # no request holds a block; the pages keep theirs
    assert cache.attach_prefix("b", prompt) == 2 * P
    assert cache.take_resumes() == {"b": "at 2P"}
    tables = cache.tables["b"]
    # Window: positions 25..31 are read from 2P = 32, blocks 6 and 7 of 4 positions: shared, aligned.
    assert tables["window"].blocks == [-1] * 6 + table_a["window"][6:8]
    # r4: 8 entries in blocks of 8, shared; r16: 2 entries in a block of 8: the request's own copy.
    assert tables["compressed_r4"].blocks == table_a["compressed_r4"]
    (copy,) = tables["compressed_r16"].blocks
    assert copy != table_a["compressed_r16"][0]
    assert cache.take_copies() == [(table_a["compressed_r16"][0], copy)] and cache.take_copies() == []
    assert cache.allocate("b", 2 * P, 2 * P + 3)
    cache.free_request("b")
    while (blocks := cache.prefix.evict()) is not None:
        for block in blocks:
            cache._drop(block, by_request=False)
    assert sorted(cache.free) == list(range(cache.num_blocks)) and not any(cache.refs)


def test_memory_pressure_evicts_unused_pages_and_never_pages_in_use():
    cache = manager(num_blocks=14)
    prompt = tokens(2 * P + 1)
    assert cache.allocate("a", 0, 2 * P)
    cache.register("a", prompt[: 2 * P], state=None)
    cache.free_request("a")
    assert len(cache.free) < cache.num_blocks and cache.prefix.num_pages() == 2
    assert cache.attach_prefix("b", prompt) == 2 * P  # b reads the pages
    assert not cache.allocate("c", 0, 40)  # the pages b reads cannot make room
    assert cache.prefix.num_pages() == 2
    cache.free_request("b")
    assert cache.allocate("c", 0, 40)  # now they can
    assert cache.prefix.num_pages() == 0 and cache.attach_prefix("d", prompt) == 0


def test_fuzz_every_registered_boundary_is_found_again():
    rng = random.Random(7)
    cache = manager(num_blocks=4096)
    registered: list[list[int]] = []
    for i in range(40):
        base = registered[rng.randrange(len(registered))] if registered and rng.random() < 0.6 else []
        prompt = base[: rng.randrange(len(base) + 1)] + tokens(rng.randrange(1, 5 * P), seed=100 + i)
        start = cache.attach_prefix(f"r{i}", prompt)
        for boundary in range(start + P - start % P, len(prompt) + 1, P):
            assert cache.allocate(f"r{i}", start, boundary)
            cache.take_copies()
            if rng.random() < 0.5:
                cache.register(f"r{i}", prompt[:boundary], state=boundary)
                registered.append(prompt[:boundary])
            cache.release_old(f"r{i}", boundary)
            start = boundary
        cache.free_request(f"r{i}")
    for prefix in registered:
        assert cache.attach_prefix("probe", prefix + [5]) == len(prefix)
        assert cache.take_resumes() == {"probe": len(prefix)}
        cache.free_request("probe")
    assert cache.num_free == cache.num_blocks
