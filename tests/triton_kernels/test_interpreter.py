"""The numpy XOR reduction of the interpreter (``triton_kernels.interpreter``) computes what tl does."""

from __future__ import annotations

import functools
import operator

import torch
import triton
import triton.language as tl

from triton_kernels import interpreter


@triton.jit
def _xor_rows_kernel(x_ptr, out_ptr, N: tl.constexpr, M: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, N)[:, None] * M + tl.arange(0, M)[None, :])
    tl.store(out_ptr + tl.arange(0, N), tl.xor_sum(x, axis=1))


@triton.jit
def _sort_kernel(x_ptr, out_ptr, N: tl.constexpr):
    tl.store(out_ptr + tl.arange(0, N), tl.sort(tl.load(x_ptr + tl.arange(0, N))))


def test_the_test_session_interprets_with_the_fast_path() -> None:
    assert interpreter.install()


def test_xor_reduction_equals_python_xor() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-(2**31), 2**31 - 1, (8, 16), generator=gen, dtype=torch.int32)
    out = torch.empty(8, dtype=torch.int32)
    _xor_rows_kernel[(1,)](x, out, N=8, M=16)
    assert out.tolist() == [functools.reduce(operator.xor, row) for row in x.tolist()]


def test_sort_equals_torch_sort_with_ties_and_infinities() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(-4, 5, (512,), generator=gen).float()
    x[::37], x[5::41] = float("inf"), float("-inf")
    out = torch.empty_like(x)
    _sort_kernel[(1,)](x, out, N=512)
    assert torch.equal(out, torch.sort(x).values)
