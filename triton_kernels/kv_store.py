"""Writes KV rows into the paged cache: the window keys, the compressed entries and the index keys, as
they are (``store_rows``) or each row quantised as it is stored (``store_quantized``, model-spec §9.4).

Contract
    ``store_rows(rows [M, D] fp32 | bf16, slots [M] int32 | int64, pool [num_slots, D] fp32 | bf16)``
    writes row ``m``, cast to the pool's dtype, at slot ``slots[m]`` of ``pool`` (``-1``: not written),
    with no host read (a captured graph holds it whatever the slots are). ``pool`` may be a column range
    of a wider buffer (any row stride). Slots are distinct among the rows written.
    ``store_quantized(rows [M, D] fp32 | bf16, slots [M] int32 | int64, cache)`` writes row ``m`` at slot
    ``slots[m]`` (``-1``: not written) of ``cache`` (``QuantizedRows``): its first ``N`` channels as codes
    ``codes [num_slots, N]`` (int8, or float8_e4m3fn on devices that have it) with one scale per slot
    ``scale [num_slots]`` fp32, ``scale = amax(|row[:N]|) / QMAX`` (127 for int8, 448 for E4M3; 0 for an
    all-zero row, whose codes are 0), int8 codes ``round(x / scale)`` with halves away from zero
    (``quant.quantize_int8_ref``), E4M3 codes ``x / scale`` rounded to nearest even; the last ``D - N``
    channels (the RoPE dims) unchanged into ``rope [num_slots, D - N]`` in the compute dtype (None when
    ``N = D``: index keys). Every tensor of ``cache`` may be a column range of a wider buffer (any row
    stride), as the cache's pools are. Slots are distinct among the rows written.
    Limits: ``D <= MAX_DIM``, every tensor under 2**31 elements (int32 offsets).

Kernels
    One task is ``BLOCK // BLOCK_D`` rows (``BLOCK_D``: the row width padded to a power of two): one load
    of each row and one scattered store (``store_rows``); or its amax over the NoPE channels, and three
    scattered stores (codes, scale, RoPE dims).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from triton_kernels import runtime, tuning
from triton_kernels.quant import quantize_int8_ref
from triton_kernels.shared import TINY, quantize_rows
from triton_kernels.spec import TuneConfig, Variant

MAX_DIM = 1024
CODE_DTYPES = (torch.int8, torch.float8_e4m3fn)
_ROW_DTYPES = (torch.float32, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)
_MAX_NUMEL = 2**31 - 1
_FP8_MAX = 448.0  # the largest finite E4M3 value


@dataclass(frozen=True)
class QuantizedRows:
    """One layer's rows of one kind in a quantised cache (views of the cache buffer)."""

    codes: torch.Tensor  # [num_slots, N] int8 | float8_e4m3fn: the NoPE channels
    scale: torch.Tensor  # [num_slots] fp32
    rope: torch.Tensor | None = None  # [num_slots, D - N] fp32 | bf16: the RoPE channels, None if N = D

    @property
    def width(self) -> int:
        return self.codes.shape[1] + (0 if self.rope is None else self.rope.shape[1])

    def dequantized(self, slots: torch.Tensor) -> torch.Tensor:
        """The fp32 rows at ``slots`` (any shape, valid slot ids): only those rows are decoded."""
        codes = self.codes.index_select(0, slots.flatten()).float()
        rows = codes * self.scale.index_select(0, slots.flatten())[:, None]
        if self.rope is not None:
            rows = torch.cat([rows, self.rope.index_select(0, slots.flatten()).float()], dim=1)
        return rows.view(*slots.shape, self.width)


def store_rows(rows: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor) -> None:
    validate_store(rows, slots, pool)
    run = store_rows_triton if runtime.use_triton(rows) else store_rows_ref
    run(rows, slots, pool)


def validate_store(rows: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor) -> None:
    """``store_rows``'s checks of its arguments (also those of a store fused into another op)."""
    _validate_rows(rows, slots)
    if (
        pool.dtype not in _ROW_DTYPES
        or pool.dim() != 2
        or pool.shape[1] != rows.shape[1]
        or pool.stride(1) != 1
    ):
        raise ValueError(
            f"pool: {pool.dtype} {tuple(pool.shape)} must be [num_slots, {rows.shape[1]}] of {_ROW_DTYPES}"
        )
    _validate_placement(
        rows, slots, {"slots": slots, "pool": pool}, {"rows": rows, "pool": pool}, pool.shape[0]
    )


def store_quantized(rows: torch.Tensor, slots: torch.Tensor, cache: QuantizedRows) -> None:
    _validate(rows, slots, cache)
    run = store_quantized_triton if runtime.use_triton(rows) else store_quantized_ref
    run(rows, slots, cache)


def _validate_rows(rows: torch.Tensor, slots: torch.Tensor) -> None:
    if rows.dtype not in _ROW_DTYPES or rows.dim() != 2 or not 1 <= rows.shape[1] <= MAX_DIM:
        raise ValueError(
            f"rows: {rows.dtype} {tuple(rows.shape)} must be [M, D <= {MAX_DIM}] of {_ROW_DTYPES}"
        )
    if slots.dtype not in _INDEX_DTYPES or slots.shape != rows.shape[:1]:
        raise ValueError(
            f"slots: {slots.dtype} {tuple(slots.shape)} must be [{rows.shape[0]}] of {_INDEX_DTYPES}"
        )


def _validate_placement(
    rows: torch.Tensor, slots: torch.Tensor, placed: dict, addressed: dict, num_slots: int
) -> None:
    """Every tensor in ``placed`` on the rows' device, those ``addressed`` by int32 offsets under the limit,
    and (with ``DSV4_CHECK_RANGES``) the slots in ``[-1, num_slots)``."""
    for name, x in placed.items():
        if x is not None and x.device != rows.device:
            raise ValueError(f"{name}: device {x.device} differs from rows' device {rows.device}")
    for name, x in addressed.items():
        if x is not None and x.shape[0] * x.stride(0) > _MAX_NUMEL:
            raise ValueError(f"{name}: {x.shape[0] * x.stride(0)} elements exceeds the limit {_MAX_NUMEL}")
    if runtime.check_ranges() and slots.numel():
        low, high = (int(v) for v in torch.stack([slots.min(), slots.max()]).tolist())
        if low < -1 or high >= num_slots:
            raise ValueError(f"slots: range [{low}, {high}] must lie in [-1, {num_slots}) (cache slots)")


def _validate(rows: torch.Tensor, slots: torch.Tensor, cache: QuantizedRows) -> None:
    codes, scale, rope = cache.codes, cache.scale, cache.rope
    _validate_rows(rows, slots)
    if codes.dtype not in CODE_DTYPES or codes.dim() != 2 or codes.stride(1) != 1:
        raise ValueError(f"codes: {codes.dtype} {tuple(codes.shape)} must be [num_slots, N] of {CODE_DTYPES}")
    if cache.width != rows.shape[1]:
        raise ValueError(f"cache: rows of {cache.width} channels, rows given have {rows.shape[1]}")
    if scale.dtype != torch.float32 or scale.shape != codes.shape[:1]:
        raise ValueError(f"scale: {scale.dtype} {tuple(scale.shape)} must be float32 ({codes.shape[0]},)")
    if rope is not None and (
        rope.dtype not in _ROW_DTYPES or rope.shape[0] != codes.shape[0] or rope.stride(1) != 1
    ):
        raise ValueError(
            f"rope: {rope.dtype} {tuple(rope.shape)} must be [{codes.shape[0]}, D - N] of {_ROW_DTYPES}"
        )
    placed = {"slots": slots, "codes": codes, "scale": scale, "rope": rope}
    _validate_placement(rows, slots, placed, {"rows": rows, "codes": codes, "rope": rope}, codes.shape[0])


def quantize_codes_ref(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x [M, N]`` as codes of ``dtype`` and their scales (the contract's rounding)."""
    if dtype == torch.int8:
        return quantize_int8_ref(x)
    scale = x.float().abs().amax(dim=-1) / _FP8_MAX
    return (x.float() / scale.clamp_min(TINY.value)[:, None]).to(dtype), scale


def store_rows_ref(rows: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor) -> None:
    """``pool[slots] = rows`` (any trailing shape) where ``slots >= 0``, as one ``index_put_`` of every row
    (no host read: a graph replays it whatever the slots). A row of slot -1 writes the first kept row
    again (its slot, its value), or, when none is kept, the pool's own row back: a slot two rows share
    gets the same value from both."""
    if not len(slots):
        return
    keep = slots >= 0
    source = torch.where(keep, torch.arange(len(slots), device=slots.device), keep.int().argmax())
    target = slots[source].clamp(min=0)
    kept = keep[source].view(-1, *[1] * (rows.dim() - 1))
    pool.index_put_((target,), torch.where(kept, rows[source].to(pool.dtype), pool[target]))


def store_quantized_ref(rows: torch.Tensor, slots: torch.Tensor, cache: QuantizedRows) -> None:
    nope = cache.codes.shape[1]
    codes, scale = quantize_codes_ref(rows[:, :nope], cache.codes.dtype)
    store_rows_ref(codes, slots, cache.codes)
    store_rows_ref(scale, slots, cache.scale)
    if cache.rope is not None:
        store_rows_ref(rows[:, nope:], slots, cache.rope)


@triton.jit
def _task_rows(x_ptr, slot_ptr, rows, cols, M, D):
    """Which of ``rows`` are written (slot >= 0), their slots (0 where not), and their ``[rows, cols]``
    tile of ``x [M, D]`` as stored (0 past its end)."""
    slot = tl.load(slot_ptr + rows, mask=rows < M, other=-1)
    valid = slot.to(tl.float32) >= 0  # the sign, exact in fp32
    x = tl.load(
        x_ptr + rows[:, None] * D + cols[None, :], mask=(rows < M)[:, None] & (cols < D)[None, :], other=0.0
    )
    return valid, tl.where(valid, slot, 0), x


@triton.jit(do_not_specialize=["M"])
def _store_rows_kernel(
    x_ptr, slot_ptr, pool_ptr, M, D, pool_stride, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr
):
    ROWS: tl.constexpr = BLOCK // BLOCK_D
    cols = tl.arange(0, BLOCK_D)
    for task in range(tl.program_id(0), tl.cdiv(M, ROWS), tl.num_programs(0)):
        valid, target, x = _task_rows(x_ptr, slot_ptr, task * ROWS + tl.arange(0, ROWS), cols, M, D)
        at = pool_ptr + target[:, None] * pool_stride + tl.minimum(cols, D - 1)[None, :]
        written = valid[:, None] & (cols < D)[None, :]
        tl.store(at, x.to(pool_ptr.dtype.element_ty), mask=written)  # in-bounds: slot and column clamped


def store_rows_triton(rows: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor) -> None:
    m, d = rows.shape
    if m == 0:
        return
    block_d = triton.next_power_of_2(d)
    tuned = _rows_tuned
    tuned[lambda meta: tuned.grid(triton.cdiv(m, meta["BLOCK"] // block_d))](
        rows.contiguous(), slots.contiguous(), pool, m, d, pool.stride(0), BLOCK_D=block_d
    )


@triton.jit(do_not_specialize=["M"])
def _store_quantized_kernel(
    x_ptr,
    slot_ptr,
    codes_ptr,
    scale_ptr,
    rope_ptr,
    M,
    D,
    N,
    code_stride,
    scale_stride,
    rope_stride,
    FP8: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK: tl.constexpr,
):
    ROWS: tl.constexpr = BLOCK // BLOCK_D
    cols = tl.arange(0, BLOCK_D)
    for task in range(tl.program_id(0), tl.cdiv(M, ROWS), tl.num_programs(0)):
        valid, target, x = _task_rows(x_ptr, slot_ptr, task * ROWS + tl.arange(0, ROWS), cols, M, D)
        x = x.to(tl.float32)
        nope = valid[:, None] & (cols < N)[None, :]
        if FP8:
            scale = tl.max(tl.where(nope, tl.abs(x), 0.0), axis=1) / 448.0
            codes = (x / tl.maximum(scale, TINY)[:, None]).to(codes_ptr.dtype.element_ty)
        else:
            codes, scale = quantize_rows(tl.where(nope, x, 0.0))
            # Through fp32 (exact for |codes| <= 127): BiSheng plans i32 -> i8 with a tile it cannot fit.
            codes = codes.to(tl.float32).to(tl.int8)
        at = codes_ptr + target[:, None] * code_stride + tl.minimum(cols, N - 1)[None, :]
        tl.store(at, codes, mask=nope)  # in-bounds: slot and column clamped
        tl.store(scale_ptr + target * scale_stride, scale, mask=valid)  # in-bounds: slot clamped
        if ROPE:
            at = (
                rope_ptr
                + target[:, None] * rope_stride
                + tl.minimum(tl.maximum(cols - N, 0), D - N - 1)[None, :]
            )
            rope = valid[:, None] & (cols >= N)[None, :] & (cols < D)[None, :]
            tl.store(at, x.to(rope_ptr.dtype.element_ty), mask=rope)  # in-bounds: slot and column clamped


def store_quantized_triton(rows: torch.Tensor, slots: torch.Tensor, cache: QuantizedRows) -> None:
    m, d = rows.shape
    if m == 0:
        return
    codes, rope = cache.codes, cache.rope
    block_d = triton.next_power_of_2(d)
    tuned = _store_tuned
    tuned[lambda meta: tuned.grid(triton.cdiv(m, meta["BLOCK"] // block_d))](
        rows.contiguous(),
        slots.contiguous(),
        codes,
        cache.scale,
        codes if rope is None else rope,  # never read without RoPE dims
        m,
        d,
        codes.shape[1],
        codes.stride(0),
        cache.scale.stride(0),
        0 if rope is None else rope.stride(0),
        FP8=codes.dtype == torch.float8_e4m3fn,
        ROPE=rope is not None,
        BLOCK_D=block_d,
    )


def _signature(x: str, rope: str) -> dict[str, str]:
    ints = ("M", "D", "N", "code_stride", "scale_stride", "rope_stride")
    pointers = {"x_ptr": x, "slot_ptr": "*i64", "codes_ptr": "*i8", "scale_ptr": "*fp32", "rope_ptr": rope}
    return {**pointers, **dict.fromkeys(ints, "i32")}


# Per element: the loaded row tile, its fp32 copy, |x|, the quotient, the rounded int32 and int8 tiles and
# the RoPE tile in its dtype. The smallest tile holds a row of MAX_DIM.
_CONFIGS = tuple(TuneConfig({"BLOCK": b}, 7 * 4 * b) for b in (MAX_DIM, 2 * MAX_DIM))
# What Ascend launches: int8 codes (no FP8 there); window keys and entries (RoPE dims in the compute dtype,
# rows fp32 from the compressor or in the compute dtype) and index keys (no RoPE dims).
_VARIANTS = (
    Variant(
        {"FP8": 0, "ROPE": 1, "BLOCK_D": 512},
        tuple(_signature(x, r) for x, r in (("*fp32", "*fp32"), ("*bf16", "*bf16"), ("*fp32", "*bf16"))),
    ),
    Variant({"FP8": 0, "ROPE": 0, "BLOCK_D": 128}, tuple(_signature(x, "*i8") for x in ("*fp32", "*bf16"))),
)
_store_tuned = tuning.TunedKernel(_store_quantized_kernel, _CONFIGS, key=["D"], variants=_VARIANTS)


def _rows_signature(x: str, pool: str) -> dict[str, str]:
    return {
        "x_ptr": x,
        "slot_ptr": "*i32",
        "pool_ptr": pool,
        **dict.fromkeys(("M", "D", "pool_stride"), "i32"),
    }


# Per element: the loaded row tile and its copy in the pool's dtype.
_ROW_CONFIGS = tuple(TuneConfig({"BLOCK": b}, 2 * 4 * b) for b in (MAX_DIM, 2 * MAX_DIM))
# What Ascend launches: a bf16 cache, written from bf16 rows or from the compressor's fp32 entries; window
# keys and entries, and index keys.
_ROW_VARIANTS = tuple(
    Variant({"BLOCK_D": d}, tuple(_rows_signature(x, "*bf16") for x in ("*bf16", "*fp32")))
    for d in (512, 128)
)
_rows_tuned = tuning.TunedKernel(_store_rows_kernel, _ROW_CONFIGS, key=["D"], variants=_ROW_VARIANTS)
KERNELS = (_rows_tuned, _store_tuned)
