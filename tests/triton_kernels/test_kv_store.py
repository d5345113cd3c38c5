"""The cache writes, plain and quantised (model-spec §9.4): the kernels against the references, into
strided records."""

from __future__ import annotations

import pytest
import torch

from triton_kernels import runtime
from triton_kernels.kv_store import (
    QuantizedRows,
    quantize_codes_ref,
    store_quantized,
    store_quantized_ref,
    store_quantized_triton,
    store_rows,
    store_rows_ref,
    store_rows_triton,
)
from triton_kernels.quant import quantize_int8_ref

SLOTS = 40


def _records(
    width: int, rope: int, rope_dtype: torch.dtype, codes: torch.dtype = torch.int8
) -> tuple[torch.Tensor, QuantizedRows]:
    """Slots as the cache lays them out, one byte record per slot: [scale | RoPE dims | codes | padding],
    stale bytes 0xFF (NaN scales) before any write."""
    elt = torch.empty(0, dtype=rope_dtype).element_size()
    end = 4 + rope * elt
    records = torch.full((SLOTS, end + width - rope + 4), 0xFF, dtype=torch.uint8)
    return records, QuantizedRows(
        records[:, end : end + width - rope].view(codes),
        records[:, :4].view(torch.float32)[:, 0],
        records[:, 4:end].view(rope_dtype) if rope else None,
    )


def _rows(m: int, d: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    rows = torch.randn(m, d, generator=torch.Generator().manual_seed(seed)) * 4
    rows[1] = 0  # an all-zero row: scale 0, codes 0
    return rows.to(dtype)


def _slots(m: int) -> torch.Tensor:
    slots = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(1))[:m]
    slots[2] = -1  # not written
    return slots


@pytest.mark.parametrize("slots", [[2, -1, 0, -1], [-1, -1, -1, -1], [-1, 3, -1, 1], [5, 4, 3, 2]])
def test_store_rows_reference_skips_slot_minus_one(slots: list[int]) -> None:
    pool, rows = torch.arange(24.0).view(6, 4), -torch.arange(1.0, 17.0).view(4, 4)
    want = pool.clone()
    for row, slot in enumerate(slots):
        if slot >= 0:
            want[slot] = rows[row]
    store_rows_ref(rows, torch.tensor(slots), pool)
    assert torch.equal(pool, want)


@pytest.mark.parametrize(
    ("d", "dtype", "pool_dtype", "index_dtype"),
    [
        (64, torch.float32, torch.float32, torch.int32),  # tiny V4 window keys, fp32 model
        (64, torch.bfloat16, torch.bfloat16, torch.int64),
        (48, torch.float32, torch.bfloat16, torch.int32),  # fp32 compressor entries into a bf16 cache
        (32, torch.float32, torch.float32, torch.int32),  # index keys
    ],
)
def test_store_rows_kernel_matches_reference(
    d: int, dtype: torch.dtype, pool_dtype: torch.dtype, index_dtype: torch.dtype
) -> None:
    rows, slots = _rows(9, d, dtype).round(), _slots(9).to(index_dtype)  # integers: every cast exact
    buffer = torch.full((SLOTS, d + 8), float("nan"), dtype=pool_dtype)  # the pool a column range of it
    got_buffer, want_buffer = buffer.clone(), buffer.clone()
    store_rows_triton(rows, slots, got_buffer[:, 4 : 4 + d])
    store_rows_ref(rows, slots, want_buffer[:, 4 : 4 + d])
    assert torch.equal(got_buffer.isnan(), want_buffer.isnan())
    assert torch.equal(got_buffer.nan_to_num(), want_buffer.nan_to_num())  # written slots, nothing else
    assert not want_buffer[slots[slots >= 0], 4 : 4 + d].isnan().any()


def test_store_rows_validates(monkeypatch: pytest.MonkeyPatch) -> None:
    rows, slots, pool = _rows(4, 16, torch.float32), torch.arange(4), torch.zeros(SLOTS, 16)
    with pytest.raises(ValueError, match=r"pool: torch.float32 \(40, 8\) must be \[num_slots, 16\]"):
        store_rows(rows, slots, pool[:, :8])
    with pytest.raises(ValueError, match=r"slots: torch.int64 \(3,\) must be \[4\]"):
        store_rows(rows, slots[:3], pool)
    monkeypatch.setenv("DSV4_CHECK_RANGES", "1")
    with pytest.raises(ValueError, match=r"slots: range \[-2, 2\] must lie in \[-1, 40\)"):
        store_rows(rows, torch.tensor([0, 1, 2, -2]), pool)
    store_rows(rows, torch.tensor([0, -1, 2, 39]), pool)
    assert torch.equal(pool[[0, 2, 39]], rows[[0, 2, 3]]) and not pool[1].any()


@pytest.mark.parametrize(
    ("d", "rope", "dtype", "rope_dtype"),
    [
        (64, 16, torch.float32, torch.float32),  # tiny V4 window keys, fp32 model
        (64, 16, torch.bfloat16, torch.bfloat16),  # bf16 model
        (64, 16, torch.float32, torch.bfloat16),  # fp32 compressor entries into a bf16 cache
        (32, 0, torch.float32, torch.float32),  # index keys: no RoPE dims
        (48, 8, torch.float32, torch.float32),  # a row narrower than its padded tile
    ],
)
def test_kernel_matches_reference(d: int, rope: int, dtype: torch.dtype, rope_dtype: torch.dtype) -> None:
    rows, slots = _rows(9, d, dtype), _slots(9)
    (got_bytes, got), (want_bytes, want) = _records(d, rope, rope_dtype), _records(d, rope, rope_dtype)
    store_quantized_triton(rows, slots, got)
    store_quantized_ref(rows, slots, want)
    if dtype != rope_dtype:
        # The interpreter truncates fp32 -> bf16 (devices round to nearest even): the RoPE dims within an ulp.
        torch.testing.assert_close(got.rope.float(), want.rope.float(), rtol=2**-7, atol=0, equal_nan=True)
        got.rope.copy_(want.rope)
    assert torch.equal(got_bytes, want_bytes)  # every byte: the written parts, and nothing else touched
    # Written slots hold the row's codes and scale, as quantize_int8 makes them, and its RoPE dims as given.
    written = slots >= 0
    codes, scale = quantize_int8_ref(rows[written, : d - rope])
    at = slots[written]
    assert torch.equal(got.codes[at], codes) and torch.equal(got.scale[at], scale)
    if rope:
        assert torch.equal(want.rope[at], rows[written, d - rope :].to(rope_dtype))
    unwritten = torch.ones(SLOTS, dtype=torch.bool)
    unwritten[at] = False
    assert got.scale[unwritten].isnan().all() and not got.scale[at].isnan().any()


def test_dequantised_rows_recover_the_input() -> None:
    rows, slots = _rows(9, 64, torch.float32), torch.arange(9)
    _, cache = _records(64, 16, torch.float32)
    store_quantized_ref(rows, slots, cache)
    back = cache.dequantized(slots)
    assert torch.equal(back[:, 48:], rows[:, 48:])  # RoPE dims exact
    step = cache.scale[:9, None]
    assert torch.all((back[:, :48] - rows[:, :48]).abs() <= step * (0.5 + 1e-5))


def test_fp8_codes_are_e4m3_of_the_scaled_row() -> None:
    rows = _rows(5, 64, torch.float32)
    codes, scale = quantize_codes_ref(rows, torch.float8_e4m3fn)
    assert torch.equal(scale, rows.abs().amax(-1) / 448)
    assert codes.float().abs().amax(-1)[scale > 0].eq(448).all()  # the largest magnitude maps to E4M3's max
    relative = (codes.float() * scale[:, None] - rows).abs() / rows.abs().amax(-1, keepdim=True).clamp_min(
        1e-30
    )
    assert relative.max() <= 2**-4  # 3 mantissa bits: half a step of the largest binade


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FP8 kernels need a CUDA device")
def test_fp8_kernel_matches_reference_on_cuda() -> None:
    rows, slots = _rows(9, 64, torch.bfloat16).cuda(), _slots(9).cuda()
    _, got = _records(64, 16, torch.bfloat16, torch.float8_e4m3fn)
    got = QuantizedRows(*(t.cuda() for t in (got.codes, got.scale, got.rope)))
    want = QuantizedRows(*(t.clone() for t in (got.codes, got.scale, got.rope)))
    store_quantized_triton(rows, slots, got)
    store_quantized_ref(rows, slots, want)
    assert torch.equal(got.codes.view(torch.uint8), want.codes.view(torch.uint8))
    assert torch.equal(got.rope, want.rope)


def test_public_op_dispatches_and_validates(monkeypatch: pytest.MonkeyPatch) -> None:
    rows, slots = _rows(4, 64, torch.float32), torch.arange(4)
    _, cache = _records(64, 16, torch.float32)
    store_quantized(rows, slots, cache)
    with pytest.raises(ValueError, match="cache: rows of 64 channels, rows given have 32"):
        store_quantized(rows[:, :32], slots, cache)
    with pytest.raises(ValueError, match=r"slots: range \[0, 40\] must lie in \[-1, 40\)"):
        store_quantized(rows, torch.tensor([0, 1, 2, SLOTS]), cache)
    with pytest.raises(ValueError, match="codes: torch.float32"):
        store_quantized(rows, slots, QuantizedRows(torch.zeros(SLOTS, 48), cache.scale, cache.rope))
    monkeypatch.setattr(runtime, "use_triton", lambda t: True)
    launched = []
    monkeypatch.setattr("triton_kernels.kv_store.store_quantized_triton", lambda *a: launched.append(a))
    store_quantized(rows, slots, cache)
    assert launched
