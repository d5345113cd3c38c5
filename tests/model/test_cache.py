"""KV pools: every pool a view of the one block buffer, kept across ``grow``, and the block layout."""

from __future__ import annotations

import pytest
import torch

from model.cache import (
    Batch,
    CacheGroup,
    CacheLayout,
    KVPools,
    SeqCache,
    block_layout,
    group_name,
)
from model.config import ModelConfig
from model.plan import build_plan
from model.testing.tiny import ARCHS, toy_config


def pools_by_group(pools: KVPools) -> dict[str, list[torch.Tensor]]:
    """Every pool, under its cache group (the groups share the blocks, the pools of one group do not)."""
    found = {g.name: [] for g in pools.groups}
    for plan in build_plan(pools.cfg):
        found["window"].append(pools.window[plan.index].data)
        for kind in (pools.entries, pools.index_keys):
            if plan.index in kind:
                found[group_name(plan.compress_ratio)].append(kind[plan.index].data)
    return found


def shares_the_buffer(pools: KVPools, pool: torch.Tensor) -> bool:
    return pool.untyped_storage().data_ptr() == pools.buffer.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [64, 16])
@pytest.mark.parametrize("arch", ARCHS)
def test_pools_are_views_of_the_buffer_and_survive_grow(arch, block_size, dtype):
    cfg = ModelConfig.from_dict(toy_config(arch))
    pools = KVPools(cfg, CacheLayout.for_model(cfg, dtype, block_size), 2, dtype, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    for name in pools_by_group(pools):
        group = pools_by_group(pools)[name]
        assert all(shares_the_buffer(pools, pool) for pool in group), f"a {name} pool is a copy"
        assert all(pool.shape[0] == pools.num_blocks * pools.slots_per_block[name] for pool in group)
        written = [torch.randn(pool.shape, generator=generator).to(dtype) for pool in group]
        for pool, rows in zip(group, written, strict=True):
            pool.copy_(rows)
        # Read back only after every write: pools of one group that overlapped would overwrite each other.
        assert all(torch.equal(pool, rows) for pool, rows in zip(group, written, strict=True)), name

        pools.grow(pools.num_blocks + 3)
        group = pools_by_group(pools)[name]
        assert all(shares_the_buffer(pools, pool) for pool in group), f"a {name} pool is a copy after grow"
        for pool, rows in zip(group, written, strict=True):
            assert pool.shape[0] == pools.num_blocks * pools.slots_per_block[name]
            assert torch.equal(pool[: rows.shape[0]], rows), f"a {name} pool lost its contents in grow"


@pytest.mark.parametrize(
    "widths", [(64, 32), (1792, 768, 512), (3328, 384, 768), (45056, 26880, 20480), (65536, 38400, 31744)]
)
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_block_layout_tiles_every_block_with_every_group(widths, block_size):
    groups = tuple(CacheGroup(f"g{i}", 1, w) for i, w in enumerate(widths))
    block_bytes, slots_per_block = block_layout(groups, block_size)
    assert slots_per_block["g0"] >= block_size
    assert block_bytes <= block_size * widths[0] * 9 / 8  # the widest group's slots pad by an eighth at most
    for g in groups:
        per_block = slots_per_block[g.name]
        assert block_bytes % per_block == 0 and block_bytes // per_block >= g.bytes_per_slot


@pytest.mark.parametrize("bad", [-2, 4])
def test_batch_refuses_block_ids_outside_the_pools(bad):
    cfg = ModelConfig.from_dict(toy_config("v4"))
    pools = KVPools(cfg, CacheLayout.for_model(cfg, torch.float32, 16), 4, torch.float32, torch.device("cpu"))
    tables = {g.name: [0] for g in pools.groups}
    tables["window"] = [1, bad]
    with pytest.raises(ValueError, match=r"window block table: ids \[.*\] must lie in \[-1, 4\)"):
        Batch.build(pools, [SeqCache(tables)], [20], torch.device("cpu"))
    tables["window"] = [1, 3]
    assert Batch.build(pools, [SeqCache(tables)], [20], torch.device("cpu")).tables["window"].tolist() == [
        [1, 3]
    ]


def test_pools_refuse_a_layout_computed_for_other_groups():
    cfg = ModelConfig.from_dict(toy_config("v4"))
    bf16_layout = CacheLayout.for_model(cfg, torch.bfloat16, 16)
    with pytest.raises(ValueError, match="not this model's groups in torch.float32"):
        KVPools(cfg, bf16_layout, 2, torch.float32, torch.device("cpu"))
    pools = KVPools(cfg, bf16_layout, 2, torch.bfloat16, torch.device("cpu"))
    assert pools.slots_per_block is bf16_layout.slots_per_block


def test_the_entries_each_token_sees_are_built_once_on_the_host():
    """Per compressed group: the visible counts, the key table up to the last block any token sees, and
    (for the ratios of HCA layers only) the list of every visible entry, -1 beyond."""
    cfg = ModelConfig.from_dict(toy_config("v4"))
    pools = KVPools(cfg, CacheLayout.for_model(cfg, torch.float32, 16), 8, torch.float32, torch.device("cpu"))
    seqs = [SeqCache({g.name: [i, 7 - i] for g in pools.groups}) for i in range(2)]
    seqs[1].num_tokens = 300  # past two windows of 128
    batch = Batch.build(pools, seqs, [6, 3], torch.device("cpu"))
    hca = {p.compress_ratio for p in build_plan(cfg) if p.attention.name == "HCA"}
    assert set(batch.entries) == {g.ratio for g in pools.groups[1:]} and hca
    for ratio, meta in batch.entries.items():
        assert torch.equal(meta.visible, ((batch.positions + 1) // ratio).int())
        per_block = pools.slots_per_block[group_name(ratio)]
        blocks = -(-batch.max_entries(ratio) // per_block)
        assert torch.equal(meta.key_table, batch.tables[group_name(ratio)][:, :blocks].int())
        if ratio not in hca:
            assert meta.every is None
            with pytest.raises(ValueError, match=f"ratio {ratio}: no HCA layer compresses at it"):
                batch.every_visible_entry(ratio)
            continue
        assert meta.visible.max() > 0
        for t, seen in enumerate(meta.visible.tolist()):
            row = meta.every[t].tolist()
            assert row == list(range(seen)) + [-1] * (len(row) - seen)
