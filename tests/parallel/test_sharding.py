"""The sharding rule and the sliced load, in one process (loading needs no collective): the ranks' slices
tile every split tensor, each routed expert lives on exactly one rank, and a rank's tensors are exactly
its slices of the whole model's."""

from __future__ import annotations

import re

import pytest
import torch

from model.checkpoint import build_model, load_model, plan_shard
from model.config import ModelConfig
from model.parallel.context import ParallelContext
from model.parallel.sharding import shard_model
from model.shards import TensorSlice
from model.testing.release_like import to_msmodelslim
from model.testing.tiny import cached_tiny

WORLD = 2


def _plans(path, world: int = WORLD) -> list:
    cfg = ModelConfig.from_file(path)
    return [shard_model(build_model(cfg, path), ParallelContext(rank, world)) for rank in range(world)]


@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_the_ranks_slices_tile_every_split_tensor_and_experts_live_once(arch: str):
    path = cached_tiny(arch)
    whole = build_model(ModelConfig.from_file(path), path).checkpoint_names()
    plans = _plans(path)
    assert plans[0].slices.keys() == plans[1].slices.keys()
    for name, first in plans[0].slices.items():
        second = plans[1].slices[name]
        assert first.dim == second.dim and first.start == 0
        assert first.stop == second.start and second.stop == whole[name][first.dim], name
    experts = {n for n in whole if re.search(r"\.experts\.\d+\.", n)}
    held = [experts - plan.elsewhere for plan in plans]
    assert held[0].isdisjoint(held[1]) and held[0] | held[1] == experts
    assert len(held[0]) == len(held[1])


def test_a_model_that_does_not_divide_is_refused_naming_the_numbers():
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide num_attention_heads=4"):
        _plans(cached_tiny("v41"), world=3)


@pytest.mark.parametrize(
    ("arch", "fp8", "quantization"),
    [
        ("v4", False, "auto"),
        ("v41", False, "auto"),
        ("v4", True, "dense"),
        ("v4", True, "auto"),
        ("v4", True, "w8a8"),
    ],  # fmt: skip
)
def test_a_rank_loads_exactly_its_slices_of_the_whole_model(
    fp8_tiny, arch: str, fp8: bool, quantization: str
):
    """Rows are read as byte ranges, columns cut after the read; FP8 either dequantised then cut, kept
    packed with the block scales of its slice, or requantised to W8A8 (a row slice takes its rows' scales,
    a column slice the whole scales); MXFP4 experts whole."""
    part, plan = _rank_matches_whole(fp8_tiny if fp8 else cached_tiny(arch), quantization)
    if quantization == "w8a8":  # int8 slices, the scales of the rows they hold
        assert any(part[n].dtype == torch.int8 for n in plan.slices)
        assert any(n.endswith(".weight_scale") for n in plan.slices)
    if fp8 and quantization == "auto":  # kept packed: E4M3 slices with their block scales
        assert any(part[n].dtype == torch.float8_e4m3fn for n in plan.slices)
        assert any(n.endswith(".scale") for n in plan.slices)


@pytest.mark.parametrize("layout", ["msmodelslim", "msmodelslim-w4a8"])
def test_a_rank_loads_its_slices_of_a_stored_w8a8_checkpoint(tmp_path, layout: str):
    """msModelSlim's int8 linears (and int4 routed experts) keep their stored bytes under TP."""
    part, plan = _rank_matches_whole(to_msmodelslim(cached_tiny("v4"), tmp_path / layout, layout), "auto")
    assert any(part[n].dtype == torch.int8 for n in plan.slices)
    assert any(n.endswith(".weight_offset") for n in plan.slices)


def _rank_matches_whole(path, quantization: str) -> tuple[dict, object]:
    """Rank 1's tensors: its slices of the whole model's, the replicated ones equal, no other rank's."""
    whole = load_model(path, quantization=quantization).official_state()
    _, _, plan = plan_shard(path, quantization=quantization, parallel=ParallelContext(1, WORLD))
    part = load_model(path, quantization=quantization, parallel=ParallelContext(1, WORLD)).official_state()
    for name, piece in plan.slices.items():
        assert torch.equal(part[name], piece.take(whole[name])), name
    for name in set(whole) - set(plan.slices) - plan.elsewhere:
        assert torch.equal(part[name], whole[name]), name
    assert not plan.elsewhere & set(part)
    return part, plan


def test_an_fp8_slice_off_the_block_boundary_is_refused_naming_it():
    with pytest.raises(
        ValueError, match=r"layers.0.attn.wo_a.weight: .* \[32, 64\) of dimension 0 .* block of 64"
    ):
        TensorSlice(0, 32, 64).blocks(64, "layers.0.attn.wo_a.weight")
    assert TensorSlice(1, 64, 128).blocks(64, "w") == TensorSlice(1, 1, 2)
