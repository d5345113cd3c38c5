from __future__ import annotations

import dataclasses

import pytest
import torch

from triton_kernels import runtime, sparse_attn
from triton_kernels.kv_store import QuantizedRows, store_quantized_ref
from triton_kernels.rope import apply_rope_ref, rope_inv_freq
from triton_kernels.sparse_attn import KVPool, sparse_attention, sparse_attention_ref, sparse_attention_triton

SLOTS = 700


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _indices(t: int, k: int, seed: int, empty_rows: tuple[int, ...] = ()) -> torch.Tensor:
    """Random slots with about a quarter invalid; ``empty_rows`` have no valid slot at all."""
    idx = torch.randint(0, SLOTS, (t, k), generator=_gen(seed), dtype=torch.int32)
    idx[torch.rand(t, k, generator=_gen(seed + 1)) < 0.25] = -1
    idx[list(empty_rows)] = -1
    return idx


QUANTIZED = {"int8": torch.int8, "int8_bf16": torch.int8, "fp8": torch.float8_e4m3fn}


def quantized_rows(kv: torch.Tensor, codes: torch.dtype, rope_dtype: torch.dtype) -> QuantizedRows:
    """``kv [S, D]`` stored as the cache stores it (model-spec §9.4): one byte record per slot holding the
    scale, the last quarter of the channels (RoPE) in ``rope_dtype`` and the codes of the others, so that
    every part is a column range of the records (strided, as in the cache buffer)."""
    slots, d = kv.shape
    rope, elt = d // 4, torch.empty(0, dtype=rope_dtype).element_size()
    records = torch.zeros(slots, 4 + rope * elt + d - rope + 4, dtype=torch.uint8)  # 4 bytes of padding
    end = 4 + rope * elt
    cache = QuantizedRows(
        records[:, end : end + d - rope].view(codes),
        records[:, :4].view(torch.float32)[:, 0],
        records[:, 4:end].view(rope_dtype),
    )
    store_quantized_ref(kv, torch.arange(slots), cache)
    return cache


def _case(t: int, h: int, d: int, kw: int, kc: int, kind: str, seed: int = 0):
    """Query, two pools (window, compressed) sharing one KV table, per-head sinks; the second row has no
    valid slot in either pool. Quantised kinds: int8 (fp32 queries and RoPE dims), int8_bf16 (bf16
    queries and RoPE dims), fp8 (E4M3 codes)."""
    dtype = torch.bfloat16 if kind in ("bf16", "int8_bf16") else torch.float32
    q = torch.randn(t, h, d, generator=_gen(seed)).to(dtype)
    kv = torch.randn(SLOTS, d, generator=_gen(seed + 1))
    parts = {"kv": kv.to(dtype)}
    if kind in QUANTIZED:
        rows = quantized_rows(kv, QUANTIZED[kind], dtype)
        parts = {"kv": rows.codes, "scale": rows.scale, "rope": rows.rope}
    empty = (1,) if t > 1 else ()
    pools = [
        KVPool(indices=_indices(t, kw, seed + 2, empty), **parts),
        KVPool(indices=_indices(t, kc, seed + 4, empty), **parts),
    ]
    sink = torch.randn(h, generator=_gen(seed + 6))
    return q, pools, sink


def _rope(t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 1 << 20, (t,), generator=_gen(seed)), rope_inv_freq(16, 160000.0)


def _check(q, pools, sink, rope, split: bool, atol: float) -> None:
    positions, inv_freq = rope if rope else (None, None)
    scale = q.shape[-1] ** -0.5
    out, lse = sparse_attention_triton(q, pools, sink, scale, positions, inv_freq, split=split)
    ref_out, ref_lse = sparse_attention_ref(q, pools, sink, scale, positions, inv_freq)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.float(), ref_out.float(), atol=atol, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("split", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize(
    ("t", "h", "d", "kw", "kc"),
    [
        (5, 1, 64, 16, 40),
        (6, 4, 64, 128, 512),
        (3, 16, 32, 7, 0),
        (2, 16, 512, 128, 512),
        (1, 4, 512, 128, 33),
    ],
)
def test_kernel_matches_reference(t: int, h: int, d: int, kw: int, kc: int, split: bool) -> None:
    q, pools, sink = _case(t, h, d, kw, kc, "fp32")
    _check(q, pools, sink, _rope(t), split, atol=1e-5)


@pytest.mark.parametrize("split", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("kind", ["bf16", "int8", "int8_bf16"])
def test_kernel_matches_reference_on_bf16_and_quantised_pools(kind: str, split: bool) -> None:
    # Quantised pools are compared against the attention over their dequantised rows, in fp32: the kernel
    # decodes the codes, scales and RoPE dims of each tile in registers.
    q, pools, sink = _case(4, 4, 64, 32, 96, kind, seed=3)
    _check(q, pools, sink, _rope(4), split, atol=1e-2 if q.dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("split", [False, True], ids=["prefill", "decode"])
def test_extreme_sinks_and_rows_without_slots(split: bool) -> None:
    q, pools, _ = _case(3, 4, 64, 16, 24, "fp32", seed=5)
    sink = torch.tensor([1e4, -1e4, float("-inf"), 0.0])
    _check(q, pools, sink, None, split, atol=1e-5)
    out, lse = sparse_attention_triton(q, pools, sink, 0.125, split=split)
    assert torch.all(out[:, 0] == 0)  # a huge sink takes all the weight
    assert torch.all(out[1] == 0) and torch.all(lse[1] == float("-inf"))  # no valid slot: zeros, no NaN


def test_single_pool_and_empty_batch() -> None:
    q, pools, sink = _case(3, 4, 64, 16, 0, "fp32")
    _check(q, pools[:1], sink, _rope(3), split=False, atol=1e-5)
    out, lse = sparse_attention_triton(q[:0], [KVPool(p.kv, p.indices[:0]) for p in pools], sink, 0.1)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)


def test_reference_is_softmax_with_a_sink_column() -> None:
    q, pools, sink = _case(4, 4, 32, 8, 8, "fp32", seed=7)
    scale = 32**-0.5
    rows = torch.cat([p.kv[p.indices.clamp(min=0).long()] for p in pools], dim=1)
    valid = torch.cat([p.indices >= 0 for p in pools], dim=1)
    logits = torch.einsum("thd,tkd->thk", q, rows) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    logits = torch.cat([logits, sink.view(1, -1, 1).expand(4, -1, 1)], dim=-1)
    expected = torch.einsum("thk,tkd->thd", logits.softmax(-1)[..., :-1], rows)
    out, lse = sparse_attention_ref(q, pools, sink, scale)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(lse, torch.logsumexp(logits[..., :-1], dim=-1))
    # sink -> -inf is plain softmax; the fused de-rotation is apply_rope(inverse=True) of the output.
    plain, _ = sparse_attention_ref(q, pools, torch.full((4,), float("-inf")), scale)
    torch.testing.assert_close(plain[0], torch.einsum("hk,kd->hd", logits[0, :, :-1].softmax(-1), rows[0]))
    positions, inv_freq = _rope(4)
    rotated, _ = sparse_attention_ref(q, pools, sink, scale, positions, inv_freq)
    torch.testing.assert_close(rotated, apply_rope_ref(out, positions, inv_freq, inverse=True))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantised_reference_uses_dequantised_rows(kind: str) -> None:
    q, pools, sink = _case(3, 2, 32, 8, 8, kind, seed=9)
    rows = QuantizedRows(pools[0].kv, pools[0].scale, pools[0].rope)
    dequantised = rows.dequantized(torch.arange(SLOTS))
    expected = torch.cat([pools[0].kv.float() * pools[0].scale[:, None], pools[0].rope.float()], dim=1)
    assert torch.equal(dequantised, expected)
    dequantised = [KVPool(dequantised, p.indices) for p in pools]
    for a, b in zip(
        sparse_attention_ref(q, pools, sink, 0.2),
        sparse_attention_ref(q, dequantised, sink, 0.2),
        strict=True,
    ):
        torch.testing.assert_close(a, b)


def test_public_op_dispatches_by_device(monkeypatch: pytest.MonkeyPatch) -> None:
    q, pools, sink = _case(2, 4, 64, 8, 8, "fp32")
    assert not runtime.use_triton(q)
    ref = sparse_attention_ref(q, pools, sink, 0.1)
    for a, b in zip(sparse_attention(q, pools, sink, 0.1), ref, strict=True):
        assert torch.equal(a, b)
    monkeypatch.setenv("DSV4_TRITON_ON_CPU", "1")
    assert runtime.use_triton(q)
    for a, b in zip(sparse_attention(q, pools, sink, 0.1), ref, strict=True):
        torch.testing.assert_close(a, b)


def _bad(**change):
    q, pools, sink = _case(2, 4, 64, 8, 8, "fp32")
    args = {"q": q, "pools": pools, "sink": sink, "scale": 0.1, "positions": None, "inv_freq": None}
    args.update(change)
    return args


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"q": torch.zeros(2, 4, 1024)}, "D <= 512"),
        ({"q": torch.zeros(2, 4, 64, dtype=torch.float16)}, "q: torch.float16"),
        ({"pools": []}, "pools: 0 given"),
        (
            {"pools": [KVPool(torch.zeros(10, 32), torch.zeros(2, 3, dtype=torch.int32))]},
            r"\[num_slots, 64\]",
        ),
        ({"pools": [KVPool(torch.zeros(10, 64), torch.full((2, 3), 10, dtype=torch.int32))]}, r"\[-1, 10\)"),
        ({"pools": [KVPool(torch.zeros(10, 64), torch.full((2, 3), -2, dtype=torch.int32))]}, r"range \[-2"),
        (
            {"pools": [KVPool(torch.zeros(10, 64, dtype=torch.int8), torch.zeros(2, 3, dtype=torch.int32))]},
            "rope exactly for a quantised pool",
        ),
        (
            {
                "pools": [
                    KVPool(
                        torch.zeros(10, 48, dtype=torch.int8),
                        torch.zeros(2, 3, dtype=torch.int32),
                        rope=torch.zeros(10, 16),
                    )
                ]
            },  # fmt: skip
            "scale: must be given exactly when kv is quantised",
        ),
        (
            {
                "pools": [
                    KVPool(
                        torch.zeros(10, 48, dtype=torch.int8),
                        torch.zeros(2, 3, dtype=torch.int32),
                        torch.zeros(10),
                        torch.zeros(10, 8),
                    )
                ]
            },  # fmt: skip
            "rows of 56 channels",
        ),
        ({"pools": [KVPool(torch.zeros(10, 64), torch.zeros(3, 3, dtype=torch.int32))]}, r"\[2, K\]"),
        ({"sink": torch.zeros(3)}, "sink"),
        ({"scale": 0.0}, "scale: 0.0"),
        ({"positions": torch.zeros(2, dtype=torch.int64)}, "give both"),
        ({"positions": torch.zeros(3, dtype=torch.int64), "inv_freq": torch.ones(8)}, "positions"),
        ({"positions": torch.zeros(2, dtype=torch.int64), "inv_freq": torch.ones(40)}, "inv_freq"),
    ],
)
def test_contract_is_validated(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sparse_attention(**_bad(**change))


@pytest.mark.parametrize("split", [False, True], ids=["prefill", "decode"])
def test_pools_that_are_column_ranges_of_a_buffer_are_read_in_place(split: bool, monkeypatch) -> None:
    # The KV cache's pools are column ranges of one buffer: the kernel reads them at their row stride.
    q, pools, sink = _case(4, 4, 64, 16, 40, "fp32")
    buffer = torch.randn(SLOTS, 3 * 64, generator=_gen(9))
    window, entries = buffer[:, 64:128], buffer[:, 128:]
    window.copy_(pools[0].kv)
    entries.copy_(torch.randn(SLOTS, 64, generator=_gen(10)))
    strided = [KVPool(window, pools[0].indices), KVPool(entries, pools[1].indices)]
    copied = []
    contiguous = torch.Tensor.contiguous
    monkeypatch.setattr(torch.Tensor, "contiguous", lambda t, *a: copied.append(t.shape) or contiguous(t, *a))
    _check(q, strided, sink, _rope(4), split, atol=1e-5)
    assert (SLOTS, 64) not in copied, "a pool was copied"


@pytest.mark.parametrize("split", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8"])
def test_heads_past_one_tile_and_ragged_key_tiles(kind: str, split: bool) -> None:
    # 80 heads: a full tile of MAX_HEAD_TILE and a second one mostly padding; 70 and 5 slots: a ragged last
    # key tile in each pool; a head dim of 48: a ragged channel slice; and a row without valid slot.
    h = sparse_attn.MAX_HEAD_TILE + 16
    q, pools, sink = _case(2, h, 48, 70, 5, kind, seed=11)
    _check(q, pools, sink, None, split, atol=1e-2 if kind == "bf16" else 1e-5)


@pytest.mark.parametrize("config", sparse_attn._DECODE_CONFIGS, ids=lambda c: f"SPLITS={c.params['SPLITS']}")
def test_every_decode_split_merges_to_the_reference(config) -> None:
    # With 8 splits of whole key tiles most splits of these pools are empty: the merge must ignore them.
    q, pools, sink = _case(3, 4, 64, 70, 130, "fp32", seed=13)
    with sparse_attn._decode_tuned.forced(config):
        _check(q, pools, sink, _rope(3), split=True, atol=1e-5)


@pytest.mark.parametrize("split", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("kind", ["fp32", "int8"])
def test_window_slots_in_runs_are_read_as_pages(kind: str, split: bool) -> None:
    # A ring serves the window's slots: whole tiles of consecutive slots (pages), a tile wrapping past the
    # last slot, and a window not full yet, whose first tile is partly invalid.
    q, pools, sink = _case(3, 4, 64, 128, 40, kind, seed=15)
    start = torch.tensor([0, SLOTS - 100, 300])
    window = ((start[:, None] + torch.arange(128)) % SLOTS).to(torch.int32)
    window[2, :70] = -1
    pages = [dataclasses.replace(pools[0], indices=window), pools[1]]
    _check(q, pages, sink, _rope(3), split, atol=1e-5)
