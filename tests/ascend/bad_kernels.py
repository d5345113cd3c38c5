"""Kernels the Ascend gate must fail, one per kind of failure (see check_negative.py).

Each ``# gate:`` marker is on the line the gate's message must name, followed by text the message must
contain. This file lives outside ``triton_kernels`` so the gate run on the real kernels never sees it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from triton_kernels.spec import TuneConfig, Variant
from triton_kernels.tuning import TunedKernel

_VEC = {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32"}
_CONFIG = (TuneConfig({"BLOCK": 1024}, 8 * 1024),)


# A2/A3 have no FP8: the front end rejects the type.
@triton.jit
def fp8_cast_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, x.to(tl.float8e4nv).to(tl.float32), mask=offs < n)  # gate: unexpected type fp8


# The same inside a helper: the message must name the helper's line, not the call.
@triton.jit
def _to_fp8(x):
    return x.to(tl.float8e5)  # gate: unexpected type fp8


@triton.jit
def fp8_helper_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, _to_fp8(x).to(tl.float32), mask=offs < n)


# tl.where between two base pointers crashes the adapter, which names no line: the kernel's is given.
@triton.jit
def pointer_select_kernel(a_ptr, b_ptr, y_ptr, n, use_a, BLOCK: tl.constexpr):  # gate: crashed
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    src = tl.where(use_a != 0, a_ptr, b_ptr)
    tl.store(y_ptr + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


# tl.dot makes a cube+vector (mix) kernel, but its spec would launch it on vector cores.
@triton.jit
def cube_as_vector_kernel(a_ptr, c_ptr, BLOCK: tl.constexpr):  # gate: mix_mode=mix but uses_cube
    r = tl.arange(0, BLOCK)
    a = tl.load(a_ptr + r[:, None] * BLOCK + r[None, :])
    tl.store(c_ptr + r[:, None] * BLOCK + r[None, :], tl.dot(a, a))


# A gather whose mask Ascend drops (not a rectangle), with -1 indices used as addresses: lanes read
# before the tensor. It lowers fine; the dropped-mask lint must name it.
@triton.jit
def unclamped_gather_kernel(x_ptr, idx_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(idx_ptr + offs, mask=offs < n, other=-1)
    y = tl.load(x_ptr + slot, mask=slot >= 0, other=0.0)  # gate: loses its mask on Ascend
    tl.store(y_ptr + offs, y, mask=offs < n)


# A 128 KiB fp32 tile, loaded, doubled and stored: its IR buffers exceed 80 % of the unified buffer.
@triton.jit
def oversized_tile_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):  # gate: over the budget
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, x * 2.0, mask=offs < n)


# A 128 KiB fp32 tile through a cumsum: the IR holds the one tile, under the budget, but BiSheng's scan
# needs a second one beside it, 256 KiB of the 192 KiB unified buffer. Only its memory planning sees it.
@triton.jit
def scan_overflow_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):  # gate: ub overflow, requires
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.cumsum(tl.load(x_ptr + offs), 0))


# In no KERNELS entry: nothing would ever lower it.
@triton.jit
def undeclared_kernel(x_ptr, BLOCK: tl.constexpr):  # gate: in no KERNELS entry
    tl.store(x_ptr + tl.arange(0, BLOCK), tl.zeros([BLOCK], dtype=tl.float32))


KERNELS = (
    TunedKernel(fp8_cast_kernel, _CONFIG, variants=(Variant({}, (_VEC,)),)),
    TunedKernel(fp8_helper_kernel, _CONFIG, variants=(Variant({}, (_VEC,)),)),
    TunedKernel(
        pointer_select_kernel,
        _CONFIG,
        variants=(
            Variant(
                {}, ({"a_ptr": "*fp32", "b_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "use_a": "i32"},)
            ),
        ),
    ),
    TunedKernel(
        unclamped_gather_kernel,
        _CONFIG,
        variants=(Variant({}, ({"x_ptr": "*fp32", "idx_ptr": "*i32", "y_ptr": "*fp32", "n": "i32"},)),),
    ),
    TunedKernel(
        oversized_tile_kernel, (TuneConfig({"BLOCK": 32768}, 128 * 1024),), variants=(Variant({}, (_VEC,)),)
    ),
    TunedKernel(
        scan_overflow_kernel, (TuneConfig({"BLOCK": 32768}, 128 * 1024),), variants=(Variant({}, (_VEC,)),)
    ),
    TunedKernel(
        cube_as_vector_kernel,
        (TuneConfig({"BLOCK": 64}, 24 * 1024),),
        variants=(Variant({}, ({"a_ptr": "*fp16", "c_ptr": "*fp16"},)),),
    ),
)
