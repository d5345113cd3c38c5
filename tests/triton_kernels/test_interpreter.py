"""The interpreter's fast paths (``triton_kernels.interpreter``): the numpy XOR reduction computes what tl
does, helper calls inside a launch compute as before without walking the language again, and integer
arithmetic builds its overflow checks only when ``debug`` makes them act, numpy's sort gives the network's
bits, and the numpy dtypes kept are the interpreter's own answers."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import operator

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter as triton_interpreter

from triton_kernels import interpreter


@triton.jit
def _xor_rows_kernel(x_ptr, out_ptr, N: tl.constexpr, M: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, N)[:, None] * M + tl.arange(0, M)[None, :])
    tl.store(out_ptr + tl.arange(0, N), tl.xor_sum(x, axis=1))


@triton.jit
def _sort_kernel(x_ptr, out_ptr, N: tl.constexpr):
    tl.store(out_ptr + tl.arange(0, N), tl.sort(tl.load(x_ptr + tl.arange(0, N))))


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _helper_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, _twice(_twice(tl.load(x_ptr + offs))))


@triton.jit
def _plain_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs) * 4)


@triton.jit
def _int_kernel(x_ptr, y_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs) * tl.load(y_ptr + offs) - 7)


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


def test_helper_calls_compute_without_walking_the_language_again(monkeypatch: pytest.MonkeyPatch) -> None:
    walks = []
    members = inspect.getmembers
    monkeypatch.setattr(inspect, "getmembers", lambda *a: walks.append(a[0]) or members(*a))
    x, outs = torch.arange(8.0), [torch.empty(8), torch.empty(8)]
    _plain_kernel[(1,)](x, outs[0], N=8)
    plain = len(walks)
    _helper_kernel[(1,)](x, outs[1], N=8)
    assert torch.equal(outs[0], x * 4) and torch.equal(outs[1], x * 4)
    assert plain > 0 and len(walks) == 2 * plain  # the launch's own walk only, not one per helper call
    assert tl.core.is_builtin(tl.load)  # the launch put the language back


def test_integer_overflow_checks_are_built_only_when_debug_makes_them_act(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    semantic, builder = triton_interpreter.interpreter_semantic, triton_interpreter.interpreter_builder
    asserts = []
    device_assert = semantic.device_assert
    monkeypatch.setattr(semantic, "device_assert", lambda *a: asserts.append(a[1]) or device_assert(*a))
    x = torch.tensor([2**30, 3, -(2**31) + 1, 5], dtype=torch.int32)
    y = torch.tensor([4, 5, 2, -1], dtype=torch.int32)
    out = torch.empty(4, dtype=torch.int32)
    _int_kernel[(1,)](x, y, out, N=4)
    wrapped = (x.long() * y.long() - 7 + 2**31) % 2**32 - 2**31  # int32 arithmetic wraps, as before
    assert out.tolist() == wrapped.tolist() and not asserts
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, debug=True))
    with pytest.raises(
        triton_interpreter.InterpreterError, match="int32 overflow detected for operation mul"
    ):
        _int_kernel[(1,)](x, y, out, N=4)
    assert asserts


@triton.jit
def _sort_rows_kernel(x_ptr, out_ptr, N: tl.constexpr, M: tl.constexpr, DESCENDING: tl.constexpr):
    offs = tl.arange(0, N)[:, None] * M + tl.arange(0, M)[None, :]
    tl.store(out_ptr + offs, tl.sort(tl.load(x_ptr + offs), descending=DESCENDING))


@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize(
    "rows",
    [
        torch.randint(-5, 5, (4, 64), generator=torch.Generator().manual_seed(2), dtype=torch.int32),
        torch.randint(-5, 5, (4, 64), generator=torch.Generator().manual_seed(3)).float(),
        torch.tensor([[0.0, -0.0, 1.0, -0.0] * 16] * 4),  # -0.0 and 0.0 tie: the network decides
        torch.tensor([[float("nan"), 2.0, -1.0, 2.0] * 16] * 4),
    ],
    ids=["int32", "fp32", "signed zeros", "nan"],
)
def test_the_numpy_sort_gives_the_networks_bits(
    rows: torch.Tensor, descending: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast, network = torch.empty_like(rows), torch.empty_like(rows)
    _sort_rows_kernel[(1,)](rows, fast, N=4, M=64, DESCENDING=descending)
    assert tl.sort.sorts_in_numpy
    monkeypatch.setattr(tl, "sort", tl.sort.network)
    _sort_rows_kernel[(1,)](rows, network, N=4, M=64, DESCENDING=descending)
    assert torch.equal(fast.view(torch.int32), network.view(torch.int32))


def test_the_kept_numpy_dtypes_are_the_interpreters_answers() -> None:
    kept = triton_interpreter._get_np_dtype
    assert kept.answers_kept
    scalars = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.int32, tl.uint32, tl.int64, tl.uint64]
    scalars += [tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.float8e5, tl.float8e4nv]
    types = [*scalars, *(tl.block_type(s, [4, 8]) for s in scalars), tl.pointer_type(tl.float32)]
    types.append(tl.block_type(tl.pointer_type(tl.bfloat16), [16]))
    for t in types * 2:  # the second time from what was kept
        assert kept(t) == kept.lookup(t), t
