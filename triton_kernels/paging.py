"""Slots of the paged cache: where a request's position (or compressed entry) lives, through its block table.

Contract
    ``block_slots(table [B, W] int32 | int64, rows [M] int32 | int64, numbers [M] | [M, K] int32 | int64,
    per_block) -> int32, numbers' shape``::

        slot = table[rows[m], n // per_block] * per_block + n % per_block      n = numbers[m(, k)]

    and ``-1`` where ``n < 0``, ``n >= W * per_block`` (past the table) or the block id is ``-1`` (not
    allocated). ``rows`` picks each item's table row and lies in ``[0, B)``; the tables are built and
    range-checked on the host (``model/cache.py``), so nothing is checked on the device: a captured graph
    holds the lookup whatever the numbers are. Limits: every tensor under 2**31 elements, ``W * per_block``
    under 2**24 (numbers compared in fp32).

Kernel
    One task is ``BLOCK`` items: their numbers and table rows, one gather of block ids (lanes without a
    block read column 0 of row 0) and one store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_kernels import runtime, tuning
from triton_kernels.spec import TuneConfig, Variant

_INDEX_DTYPES = (torch.int32, torch.int64)
_MAX_NUMEL = 2**31 - 1
_MAX_NUMBER = 2**24  # exact in fp32


def block_slots(
    table: torch.Tensor, rows: torch.Tensor, numbers: torch.Tensor, per_block: int
) -> torch.Tensor:
    _validate(table, rows, numbers, per_block)
    return (block_slots_triton if runtime.use_triton(numbers) else block_slots_ref)(
        table, rows, numbers, per_block
    )


def _validate(table: torch.Tensor, rows: torch.Tensor, numbers: torch.Tensor, per_block: int) -> None:
    if table.dtype not in _INDEX_DTYPES or table.dim() != 2:
        raise ValueError(f"table: {table.dtype} {tuple(table.shape)} must be [B, W] of {_INDEX_DTYPES}")
    if rows.dtype not in _INDEX_DTYPES or rows.dim() != 1:
        raise ValueError(f"rows: {rows.dtype} {tuple(rows.shape)} must be [M] of {_INDEX_DTYPES}")
    if numbers.dtype not in _INDEX_DTYPES or numbers.dim() not in (1, 2) or numbers.shape[0] != rows.shape[0]:
        raise ValueError(
            f"numbers: {numbers.dtype} {tuple(numbers.shape)} must be [{rows.shape[0]}] or"
            f" [{rows.shape[0]}, K] of {_INDEX_DTYPES}"
        )
    if not 1 <= per_block or table.shape[1] * per_block >= _MAX_NUMBER:
        raise ValueError(
            f"per_block: {per_block} must be >= 1, {table.shape[1]} blocks of it under {_MAX_NUMBER} slots"
        )
    if rows.device != table.device or numbers.device != table.device:
        raise ValueError(
            f"rows / numbers: devices {rows.device} / {numbers.device} must be table's {table.device}"
        )
    if max(table.numel(), numbers.numel()) > _MAX_NUMEL:
        raise ValueError(
            f"table / numbers: {max(table.numel(), numbers.numel())} elements exceed {_MAX_NUMEL}"
        )


def block_slots_ref(
    table: torch.Tensor, rows: torch.Tensor, numbers: torch.Tensor, per_block: int
) -> torch.Tensor:
    # Each block's first slot, and a trailing column of -per_block: number -1 and the number just past the
    # table both read it, and every slot of it or of a block -1 lies in [-per_block, -1].
    firsts = torch.cat([table * per_block, table.new_full((table.shape[0], 1), -per_block)], dim=1)
    n = numbers.clamp(-1, table.shape[1] * per_block)
    row = rows if numbers.dim() == 1 else rows[:, None]
    return (firsts[row, n // per_block] + n % per_block).clamp(min=-1).to(torch.int32)


@triton.jit(do_not_specialize=["M"])
def _block_slots_kernel(
    table_ptr, rows_ptr, numbers_ptr, out_ptr, M, K, W, table_stride, per_block, BLOCK: tl.constexpr
):
    for task in range(tl.program_id(0), tl.cdiv(M, BLOCK), tl.num_programs(0)):
        at = task * BLOCK + tl.arange(0, BLOCK)
        inside = at < M
        n = tl.load(numbers_ptr + at, mask=inside, other=-1)
        row = tl.load(rows_ptr + at // K, mask=inside, other=0)
        # The sign and the bound compared in fp32 (exact below 2**24), where Ascend keeps them vectorised.
        n_f = n.to(tl.float32)
        kept = (n_f >= 0) & (n_f < W * per_block * 1.0)
        n = tl.where(kept, n, 0).to(tl.int32)
        at_block = table_ptr + row * table_stride + n // per_block
        block = tl.load(at_block, mask=kept, other=-1).to(tl.int32)  # in-bounds: lanes at 0
        kept = kept & (block.to(tl.float32) >= 0)
        slot = tl.where(kept, block * per_block + n % per_block, -1)
        tl.store(out_ptr + at, slot.to(tl.int32), mask=inside)


def block_slots_triton(
    table: torch.Tensor, rows: torch.Tensor, numbers: torch.Tensor, per_block: int
) -> torch.Tensor:
    out = torch.empty(numbers.shape, dtype=torch.int32, device=numbers.device)
    m = numbers.numel()
    if m:
        k = 1 if numbers.dim() == 1 else numbers.shape[1]
        tuned = _slots_tuned
        tuned[lambda meta: tuned.grid(triton.cdiv(m, meta["BLOCK"]))](
            table,
            rows.contiguous(),
            numbers.contiguous(),
            out,
            m,
            k,
            table.shape[1],
            table.stride(0),
            per_block,
        )
    return out


def _signature(table: str, numbers: str) -> dict[str, str]:
    pointers = {"table_ptr": table, "rows_ptr": "*i32", "numbers_ptr": numbers, "out_ptr": "*i32"}
    return {**pointers, **dict.fromkeys(("M", "K", "W", "table_stride", "per_block"), "i32")}


# Per item: the number, its fp32 copy, the row, the block id, the masks and the slot (eight 4-byte lanes).
_CONFIGS = tuple(TuneConfig({"BLOCK": b}, 8 * 4 * b) for b in (512, 1024))
# What the engine launches: int64 tables (the host's), int32 or int64 numbers (the ops', the batch's).
_slots_tuned = tuning.TunedKernel(
    _block_slots_kernel,
    _CONFIGS,
    key=["M"],
    variants=(Variant({}, (_signature("*i64", "*i32"), _signature("*i64", "*i64"))),),
)
KERNELS = (_slots_tuned,)
