"""The in-bounds check of bounds.py fails an access whose masked-out lanes leave the tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.errors import InterpreterError

from tests.triton_kernels.bounds import BoundsCheck, marked_lines


@triton.jit
def _gather_kernel(x_ptr, idx_ptr, out_ptr, n, CLAMP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    slot = tl.load(idx_ptr + offs, mask=offs < n, other=-1)
    valid = slot >= 0
    row = tl.where(valid, slot, 0) if CLAMP else slot
    y = tl.load(x_ptr + row, mask=valid, other=0.0)  # in-bounds: the line under test
    tl.store(out_ptr + offs, y, mask=offs < n)


@pytest.mark.parametrize("clamp", [True, False])
def test_masked_out_lanes_outside_the_tensor_fail(monkeypatch: pytest.MonkeyPatch, clamp: bool) -> None:
    check = BoundsCheck(marked_lines([Path(__file__)]))
    check.install(monkeypatch)
    # A view into the middle of a guard buffer: lanes that stray read NaN, and the check names them.
    guard = torch.full((64,), float("nan"))
    x = guard[16:24]
    x.copy_(torch.arange(8.0))
    idx = torch.tensor([3, -1, 7, 0, -1], dtype=torch.int32)
    out = torch.zeros(5)
    if not clamp:
        with pytest.raises(InterpreterError, match=r"OutOfBounds.*test_bounds\.py:\d+: lanes address"):
            _gather_kernel[(1,)](x, idx, out, 5, CLAMP=False, BLOCK=8)
        return
    _gather_kernel[(1,)](x, idx, out, 5, CLAMP=True, BLOCK=8)
    assert torch.equal(out, torch.where(idx >= 0, x[idx.clamp(min=0).long()], 0.0))
    assert sum(check.hits.values()) == 1
    assert guard[:16].isnan().all() and guard[24:].isnan().all()
