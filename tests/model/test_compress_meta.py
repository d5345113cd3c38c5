"""The compressor's per-step batches carry the per-token fields ``CompressBatch.build`` derives."""

from __future__ import annotations

import pytest
import torch

from model.cache import DecodeShape, _compress_meta
from model.compressor import _batch_meta
from triton_kernels.compressor import CompressBatch


def _assert_as_built(batch: CompressBatch, ratio: int) -> None:
    built = CompressBatch.build(ratio, batch.cu_seqlens, batch.start, batch.state_ids, batch.slots)
    for name, got in vars(batch).items():
        want = getattr(built, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name


@pytest.mark.parametrize("ratio", [1, 2, 4, 128])
def test_eager_step_batch_is_as_built(ratio: int) -> None:
    batch, _, _ = _batch_meta(ratio, (0, 3, 126, 7, 250), (5, 1, 9, 0, 140), torch.device("cpu"))
    _assert_as_built(batch, ratio)


@pytest.mark.parametrize("ratio", [1, 2, 4, 128])
def test_fixed_shape_step_batch_is_as_built(ratio: int) -> None:
    """Three requests of two tokens each, the last a padding row (position -1)."""
    shape = DecodeShape(rows=3, width=2, blocks=1, tokens=256)
    positions = torch.tensor([2, 3, 126, 127, -1, -1])
    request = torch.arange(3).repeat_interleave(2)
    _assert_as_built(_compress_meta(ratio, shape, positions, request).batch, ratio)
