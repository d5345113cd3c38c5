"""Symmetric int8 rows with one fp32 scale each: the Ascend indexer keys and queries (model-spec §9.4).

Contract
    ``quantize_int8(x [..., D] fp32 | bf16) -> (q [..., D] int8, scale [...] fp32)``:
    ``scale = amax(|x|) / 127`` per row, ``q = round(x / scale)`` with halves rounded away from zero
    (``q = 0`` for an all-zero row, whose scale is 0). ``x`` is recovered as ``q * scale``
    (``dequantize_int8``) within ``scale / 2`` per element. Indexer keys ``[num_slots, D]`` get a
    scale per slot, queries ``[T, H, D]`` one per (token, head).

Kernel
    One task is a tile of ``BLOCK`` elements: ``BLOCK // BLOCK_D`` whole rows (``BLOCK_D`` is the row
    width padded to a power of two), so amax and the rounded quotient need one load per row and the
    footprint does not depend on the row width (indexer rows are 128 wide).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_kernels import runtime, tuning
from triton_kernels.shared import TINY, quantize_rows
from triton_kernels.spec import TuneConfig, Variant

MAX_DIM = 1024
_DTYPES = (torch.float32, torch.bfloat16)
_MAX_NUMEL = 2**31 - 1  # offsets are int32 inside the kernel


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dtype not in _DTYPES:
        raise ValueError(f"x: dtype {x.dtype} not supported, expected one of {_DTYPES}")
    if x.dim() < 1 or not 1 <= x.shape[-1] <= MAX_DIM:
        raise ValueError(f"x: shape {tuple(x.shape)} must have a last dimension in [1, {MAX_DIM}]")
    if x.numel() > _MAX_NUMEL:
        raise ValueError(f"x: {x.numel()} elements exceeds the limit {_MAX_NUMEL}")
    return quantize_int8_triton(x) if runtime.use_triton(x) else quantize_int8_ref(x)


def quantize_int8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / 127
    y = xf / scale.clamp_min(TINY.value)[..., None]
    q = torch.sign(y) * torch.floor(y.abs() + 0.5)
    return q.clamp(-127, 127).to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[..., None]


@triton.jit(do_not_specialize=["M"])
def _quantize_int8_kernel(x_ptr, q_ptr, s_ptr, M, D, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr):
    ROWS: tl.constexpr = BLOCK // BLOCK_D
    cols = tl.arange(0, BLOCK_D)
    for task in range(tl.program_id(0), tl.cdiv(M, ROWS), tl.num_programs(0)):
        rows = task * ROWS + tl.arange(0, ROWS)
        mask = (rows[:, None] < M) & (cols[None, :] < D)
        x = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        q, scale = quantize_rows(x)
        tl.store(q_ptr + rows[:, None] * D + cols[None, :], q.to(tl.int8), mask=mask)
        tl.store(s_ptr + rows, scale, mask=rows < M)


def quantize_int8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = x.shape[-1]
    x2 = x.reshape(-1, d).contiguous()
    m = x2.shape[0]
    q = torch.empty((m, d), dtype=torch.int8, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    if m > 0:
        block_d = triton.next_power_of_2(d)
        _quantize_tuned[lambda meta: _quantize_tuned.grid(triton.cdiv(m, meta["BLOCK"] // block_d))](
            x2, q, scale, m, d, BLOCK_D=block_d
        )
    return q.view(x.shape), scale.view(x.shape[:-1])


# Per element: the loaded tile, its fp32 copy, |x|, the quotient, the rounded int32 and int8 tiles.
# The smallest tile holds a row of MAX_DIM.
_CONFIGS = tuple(TuneConfig({"BLOCK": b}, 6 * 4 * b) for b in (MAX_DIM, 2 * MAX_DIM))
_quantize_tuned = tuning.TunedKernel(
    _quantize_int8_kernel,
    _CONFIGS,
    key=["D"],
    variants=(
        Variant(
            {"BLOCK_D": 128},
            tuple(
                {"x_ptr": x, "q_ptr": "*i8", "s_ptr": "*fp32", "M": "i32", "D": "i32"}
                for x in ("*fp32", "*bf16")
            ),
        ),
    ),
)
KERNELS = (_quantize_tuned,)
