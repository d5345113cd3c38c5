"""Sparse shared-KV attention with a per-head sink (model-spec §4.4; FlashMLA's sparse interface).

Contract
    ``sparse_attention(q [T, H, D], pools, sink [H] fp32, scale, positions=None, inv_freq=None)
    -> (out [T, H, D] dtype of q, lse [T, H] fp32)``. ``q`` is fp32 or bf16. ``pools`` holds one or
    two ``KVPool`` (the sliding window, then the compressed entries): a flat pool ``kv [num_slots, D]``
    (fp32 / bf16) or a quantised one (model-spec §9.4, ``kv_store``): ``kv [num_slots, N]`` the codes of
    the first ``N`` (NoPE) channels (int8, or float8_e4m3fn where the device has it), a per-slot
    ``scale [num_slots]`` fp32 and the last ``D - N >= 1`` (RoPE) channels ``rope [num_slots, D - N]``
    (fp32 / bf16); quantised for every pool or none, any row stride (column ranges of the cache). Each
    query's global slot ids ``indices [T, K]`` (int32 / int64, ``-1`` = invalid, ``K`` may differ per
    pool and be 0). Keys are the values. Over the valid slots of both
    pools, with ``s_j = scale * q_h . kv_j``: ``lse = log sum_j exp(s_j)`` (the sink excluded, as in
    FlashMLA; ``-inf`` for a row without valid slot) and ``out = sum_j exp(s_j - lse) kv_j *
    sigmoid(lse - sink_h)``, i.e. the softmax whose denominator also holds ``exp(sink_h)``; a row
    without valid slot gives zeros. ``sink_h`` is finite or ``-inf`` (plain softmax). With
    ``positions [T]`` and ``inv_freq [P]`` the output's last ``2P`` channels are de-rotated at each
    query's position (``apply_rope(..., inverse=True)``, a pass over those channels only); ``D`` is then
    even. Quantised pools are compared against their dequantised rows (``kv * scale``, then ``rope``):
    the reference decodes the gathered rows only, the kernel decodes each tile in registers.
    Limits: ``H <= MAX_HEADS``, ``D <= MAX_DIM``, every tensor under 2**31 elements (int32 offsets).

Kernels
    ``_sparse_attn_kernel``: one task is (token, head tile, split). A head tile is all of the token's heads
    up to ``MAX_HEAD_TILE`` (``head_tile``: 128 heads make two tiles, fewer than 16 are padded to the 16
    ``tl.dot`` needs), as the heads share the token's slots: each gathered key tile serves 64 heads. At
    ``D = 512`` a ``[64, 512]`` fp32 accumulator alone would take two thirds of Ascend's unified buffer, so
    a task makes two passes over its slots, in tiles of ``BLOCK_N``:

    1. scores: per key tile, ``[BLOCK_H, D] x [D, BLOCK_N]`` on the cube, the query read in its natural
       layout and the contraction in slices of ``BLOCK_D`` channels; the scores go to a workspace in
       global memory (a row per head and program, each pool's slots padded to whole tiles, so the tiles
       are stored and read back unmasked) while the running max and sum of exponentials stay on the
       vector unit;
    2. values, one slice of ``BLOCK_D`` output channels at a time: per key tile ``exp(s - max)`` from the
       workspace times the tile's value slice, accumulated in ``[BLOCK_H, BLOCK_D]``; the slice is
       normalised and stored, so the full accumulator only ever exists in global memory (the output).

    The max is final before any exponential is weighted: nothing is rescaled, and invalid slots (score
    ``_NEG``, a zero row) add nothing. A KV row is thus gathered twice per head tile (its scores, then its
    value slices) where the one-pass kernel with 16-head tasks gathered it once per 16 heads. Both pools
    are one sequence of key tiles, each load choosing its pool by a branch (a select between two base
    pointers crashes Ascend's adapter), so a pass holds one score tile, not one per pool. The window's
    slots of a token are runs of consecutive slots (two where its ring wraps): a tile that is one such run
    (``_page``) is read as one strided block, any other tile row by row through ``gather_rows`` (every
    lane's address clamped into the pool), as are the compressed entries top-k picks.

    Prefill (``SPLITS = 1``) adds the sink in each slice's epilogue. Decode has too few (token, head tile)
    tasks to fill the cores (``decode_split``): each pool's slot axis is cut into ``SPLITS`` chunks of
    whole tiles (autotuned), partial ``(max, sum, acc)`` go to a scratch buffer and ``_merge_kernel``
    combines them by log-sum-exp, one (token, head) row per task. bf16 queries use bf16 dot operands on
    devices (fp32 accumulation); the interpreter, whose bf16 arithmetic is wrong, computes in fp32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from triton_kernels import runtime, tuning
from triton_kernels.kv_store import CODE_DTYPES, QuantizedRows
from triton_kernels.rope import apply_rope_ref, rotate_rope_channels_triton
from triton_kernels.shared import gather_rows, take_rows
from triton_kernels.spec import TuneConfig, Variant

MAX_HEADS = 128
MAX_DIM = 512
_Q_DTYPES = (torch.float32, torch.bfloat16)
_FLOAT_DTYPES = (torch.float32, torch.bfloat16)
_KV_DTYPES = (*_FLOAT_DTYPES, *CODE_DTYPES)
_INDEX_DTYPES = (torch.int32, torch.int64)
_MAX_NUMEL = 2**31 - 1  # offsets are int32 inside the kernels
_NEG = tl.constexpr(-1.0e30)  # finite running-max sentinel
MAX_HEAD_TILE = 64  # heads per task: 128 would need a [128, BLOCK_N] score tile per pool loop


@dataclass(frozen=True)
class KVPool:
    kv: torch.Tensor  # [num_slots, D] fp32 | bf16, or the NoPE codes [num_slots, N] int8 | float8_e4m3fn
    indices: torch.Tensor  # [T, K] int32 | int64: global slot ids, -1 = invalid
    scale: torch.Tensor | None = None  # [num_slots] fp32, quantised pools only
    rope: torch.Tensor | None = None  # [num_slots, D - N] fp32 | bf16, quantised pools only

    @property
    def quantized(self) -> bool:
        return self.kv.dtype in CODE_DTYPES

    @property
    def width(self) -> int:
        return self.kv.shape[1] + (0 if self.rope is None else self.rope.shape[1])


def sparse_attention(
    q: torch.Tensor,
    pools: Sequence[KVPool],
    sink: torch.Tensor,
    scale: float,
    positions: torch.Tensor | None = None,
    inv_freq: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _validate(q, pools, sink, scale, positions, inv_freq)
    run = sparse_attention_triton if runtime.use_triton(q) else sparse_attention_ref
    return run(q, pools, sink, scale, positions, inv_freq)


def _validate(
    q: torch.Tensor,
    pools: Sequence[KVPool],
    sink: torch.Tensor,
    scale: float,
    positions: torch.Tensor | None,
    inv_freq: torch.Tensor | None,
) -> None:
    if q.dtype not in _Q_DTYPES or q.dim() != 3:
        raise ValueError(f"q: {q.dtype} {tuple(q.shape)} must be [T, H, D] of {_Q_DTYPES}")
    t, h, d = q.shape
    if not 1 <= h <= MAX_HEADS or not 1 <= d <= MAX_DIM:
        raise ValueError(f"q: shape {tuple(q.shape)} needs 1 <= H <= {MAX_HEADS} and 1 <= D <= {MAX_DIM}")
    if not 1 <= len(pools) <= 2:
        raise ValueError(f"pools: {len(pools)} given, expected 1 or 2 (window, compressed)")
    quant = pools[0].quantized
    for i, pool in enumerate(pools):
        kv, idx, kv_scale, rope = pool.kv, pool.indices, pool.scale, pool.rope
        float_width = not quant and kv.dim() == 2 and kv.shape[1] != d
        if kv.dtype not in _KV_DTYPES or kv.dim() != 2 or pool.quantized != quant or float_width:
            raise ValueError(
                f"pools[{i}].kv: {kv.dtype} {tuple(kv.shape)} must be [num_slots, {d}] of {_FLOAT_DTYPES} or"
                f" codes [num_slots, N < {d}] of {CODE_DTYPES}, quantised for every pool or for none"
            )
        if (rope is not None) != quant or pool.width != d or kv.shape[1] != pools[0].kv.shape[1]:
            raise ValueError(
                f"pools[{i}]: rows of {pool.width} channels (rope given: {rope is not None}) must have {d},"
                " the last in rope exactly for a quantised pool, as many in rope for every pool"
            )
        if rope is not None and (
            rope.dtype not in _FLOAT_DTYPES or rope.shape[0] != kv.shape[0] or not 1 <= rope.shape[1] < d
        ):
            raise ValueError(
                f"pools[{i}].rope: {rope.dtype} {tuple(rope.shape)} must be [{kv.shape[0]}, D - N >= 1] of"
                f" {_FLOAT_DTYPES}"
            )
        if idx.dtype not in _INDEX_DTYPES or idx.dim() != 2 or idx.shape[0] != t:
            raise ValueError(
                f"pools[{i}].indices: {idx.dtype} {tuple(idx.shape)} must be [{t}, K] of {_INDEX_DTYPES}"
            )
        if (kv_scale is not None) != quant:
            raise ValueError(
                f"pools[{i}].scale: must be given exactly when kv is quantised (kv is {kv.dtype})"
            )
        if kv_scale is not None and (kv_scale.dtype != torch.float32 or kv_scale.shape != kv.shape[:1]):
            raise ValueError(
                f"pools[{i}].scale: {kv_scale.dtype} {tuple(kv_scale.shape)} must be float32 ({kv.shape[0]},)"
            )
        for name, x in (("kv", kv), ("indices", idx), ("scale", kv_scale), ("rope", rope)):
            if x is not None and x.device != q.device:
                raise ValueError(f"pools[{i}].{name}: device {x.device} differs from q's device {q.device}")
            if x is not None and x.shape[0] * x.stride(0) > _MAX_NUMEL:
                extent = x.shape[0] * x.stride(0)
                raise ValueError(f"pools[{i}].{name}: {extent} elements exceeds the limit {_MAX_NUMEL}")
    if sink.dtype != torch.float32 or sink.shape != (h,) or sink.device != q.device:
        raise ValueError(
            f"sink: {sink.dtype} {tuple(sink.shape)} on {sink.device} must be float32 ({h},) on {q.device}"
        )
    if not scale > 0:
        raise ValueError(f"scale: {scale} must be > 0")
    if q.numel() > _MAX_NUMEL:
        raise ValueError(f"q: {q.numel()} elements exceeds the limit {_MAX_NUMEL}")
    if (positions is None) != (inv_freq is None):
        raise ValueError("positions, inv_freq: give both (fused inverse RoPE) or neither")
    if inv_freq is not None:
        if inv_freq.dtype != torch.float32 or inv_freq.dim() != 1 or not 1 <= 2 * inv_freq.numel() <= d:
            raise ValueError(
                f"inv_freq: {inv_freq.dtype} {tuple(inv_freq.shape)} must be float32 [P], 1 <= 2P <= {d}"
            )
        if d % 2:
            raise ValueError(f"q: head dim {d} must be even for the fused inverse RoPE (pairs stay aligned)")
        if positions.dtype not in _INDEX_DTYPES or positions.shape != (t,):
            raise ValueError(
                f"positions: {positions.dtype} {tuple(positions.shape)} must be [{t}] of {_INDEX_DTYPES}"
            )
        for name, x in (("positions", positions), ("inv_freq", inv_freq)):
            if x.device != q.device:
                raise ValueError(f"{name}: device {x.device} differs from q's device {q.device}")
    if runtime.check_ranges():
        _check_slots(pools)


def _check_slots(pools: Sequence[KVPool]) -> None:
    """Slot ids in ``[-1, num_slots)``, read back from the device in one transfer."""
    stats = [s for p in pools if p.indices.numel() for s in (p.indices.min(), p.indices.max())]
    if not stats:
        return
    values = iter(torch.stack(stats).tolist())
    for i, pool in enumerate(pools):
        if pool.indices.numel():
            low, high = next(values), next(values)
            if low < -1 or high >= pool.kv.shape[0]:
                raise ValueError(
                    f"pools[{i}].indices: range [{low}, {high}] must lie in [-1, {pool.kv.shape[0]}) (slots)"
                )


def sparse_attention_ref(
    q: torch.Tensor,
    pools: Sequence[KVPool],
    sink: torch.Tensor,
    scale: float,
    positions: torch.Tensor | None = None,
    inv_freq: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    scores, values = [], []
    for pool in pools:
        slots = pool.indices.clamp(min=0).long()
        if pool.quantized:  # only the rows read are decoded
            gathered = QuantizedRows(pool.kv, pool.scale, pool.rope).dequantized(slots)
            # An invalid slot reads slot 0, whose bytes may be another group's (NaN as a scale): zeroed.
            gathered = gathered.masked_fill((pool.indices < 0)[..., None], 0.0)
        else:
            gathered = take_rows(pool.kv, slots).float()
        s = torch.bmm(q.float(), gathered.transpose(1, 2)) * scale
        scores.append(s.masked_fill((pool.indices < 0)[:, None, :], float("-inf")))
        values.append(gathered)
    s = torch.cat(scores, dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    probs = torch.exp(s - lse.nan_to_num(neginf=0.0)[..., None])  # rows without a valid slot: all 0
    # sigmoid(lse - sink) = exp(lse) / (exp(lse) + exp(sink)); NaN only when both are -inf: no output.
    keep = torch.sigmoid(lse - sink).nan_to_num(0.0)
    out = torch.bmm(probs, torch.cat(values, dim=1)) * keep[..., None]
    if inv_freq is not None:
        out = apply_rope_ref(out, positions, inv_freq, inverse=True)
    return out.to(q.dtype), lse


@triton.jit
def _operand(x, BF16_DOT: tl.constexpr):
    """A ``tl.dot`` operand: bf16 on devices for bf16 queries (fp32 accumulation), else fp32."""
    dtype: tl.constexpr = tl.bfloat16 if BF16_DOT else tl.float32
    return x.to(dtype)


@triton.jit
def _tile_slots(idx_ptr, j0, hi, BLOCK_N: tl.constexpr):
    """The key tile ``idx[j0:j0 + BLOCK_N]`` (cut at ``hi``): whether each slot is valid and a row id valid
    for every lane (-1 slots read row 0)."""
    j = j0 + tl.arange(0, BLOCK_N)
    slot = tl.load(idx_ptr + j, mask=j < hi, other=-1)
    valid = slot.to(tl.float32) >= 0  # the sign, exact in fp32: ordered int compares run on the scalar unit
    return valid, tl.where(valid, slot, 0)


@triton.jit
def _tile(i, n0, lo0, hi0, idx0_ptr, lo1, hi1, idx1_ptr, width0, BLOCK_N: tl.constexpr):
    """Key tile ``i`` of a task, the window's ``n0`` tiles then the compressed pool's: whether it is the
    window's, its slots (``_tile_slots``), its page (``_page``) and its workspace columns (the compressed
    pool's follow ``width0``)."""
    first = i < n0
    if first:
        j0 = lo0 + i * BLOCK_N
        valid, row = _tile_slots(idx0_ptr, j0, hi0, BLOCK_N)
    else:
        j0 = lo1 + (i - n0) * BLOCK_N
        valid, row = _tile_slots(idx1_ptr, j0, hi1, BLOCK_N)
        j0 += width0
    return first, valid, row, _page(valid, row, BLOCK_N), j0 + tl.arange(0, BLOCK_N)


@triton.jit
def _page(valid, row, BLOCK_N: tl.constexpr):
    """The first slot of a tile whose slots are one run of consecutive valid slots, else -1. The window's
    slots of a token are such runs (two where its ring wraps): those tiles are read as one strided block
    rather than row by row."""
    start = tl.min(row, axis=0)
    run = tl.sum(tl.where(valid & (row == start + tl.arange(0, BLOCK_N)), 1, 0), axis=0) == BLOCK_N
    return tl.where(run, start, -1)


@triton.jit
def _pool_rows(
    kv_ptr, ks_ptr, rope_ptr, S, SS, SR, row, valid, d, D, N, QUANT: tl.constexpr, DP: tl.constexpr
):
    """The channels ``d`` of rows ``row`` of one pool, fp32 or as stored: a quantised row is decoded here,
    its NoPE codes times the slot's scale, then its RoPE channels."""
    if QUANT:
        codes = gather_rows(kv_ptr, row, valid, d, N, S, False).to(tl.float32)
        scale = tl.load(ks_ptr + row * SS, mask=valid, other=0.0)  # in-bounds: rows clamped by the caller
        # The NoPE channels read RoPE column 0, the RoPE ones past D its last: both discarded.
        rope_cols = tl.minimum(tl.maximum(d - N, 0), D - N - 1)
        rope = gather_rows(rope_ptr, row, valid, rope_cols, D - N, SR, True)
        rows = tl.where((d < N)[None, :], codes * scale[:, None], rope.to(tl.float32))
    else:
        rows = gather_rows(kv_ptr, row, valid, d, D, S, D == DP)
    return rows


@triton.jit
def _tile_rows(
    first,
    page,
    kv0_ptr,
    ks0_ptr,
    rope0_ptr,
    S0,
    SS0,
    SR0,
    kv1_ptr,
    ks1_ptr,
    rope1_ptr,
    S1,
    SS1,
    SR1,
    row,
    valid,
    d,
    D,
    N,
    QUANT: tl.constexpr,
    DP: tl.constexpr,
    BF16_DOT: tl.constexpr,
):
    """The channels ``d`` of a key tile's rows, from its pool: branches, as a select between two base
    pointers crashes Ascend's adapter. The pools may differ in dtype, so each branch casts to the dot's
    operand type (both branches must give one type). A page of the window is one strided block; the
    compressed pool's slots, picked by top-k, are gathered."""
    if first:
        if page != -1:
            row = page + tl.arange(0, row.shape[0])
        rows = _operand(
            _pool_rows(kv0_ptr, ks0_ptr, rope0_ptr, S0, SS0, SR0, row, valid, d, D, N, QUANT, DP), BF16_DOT
        )
    else:
        rows = _operand(
            _pool_rows(kv1_ptr, ks1_ptr, rope1_ptr, S1, SS1, SR1, row, valid, d, D, N, QUANT, DP), BF16_DOT
        )
    return rows


@triton.jit
def _finish(acc, m, total, sink):
    """Output normalised by a denominator that holds the sink."""
    top = tl.maximum(m, sink)
    keep = tl.exp(m - top)
    denom = total * keep + tl.exp(sink - top)  # 0 only with no valid slot and sink = -inf (acc is 0 then)
    return acc * (keep / tl.where(denom > 0, denom, 1.0))[:, None]


@triton.jit
def _lse(m, total):
    """The log-sum-exp of the scores alone (the sink excluded), -inf without valid slot."""
    return tl.where(total > 0, m + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))


@triton.jit(do_not_specialize=["T", "K0", "K1"])
def _sparse_attn_kernel(
    q_ptr,
    kv0_ptr,
    ks0_ptr,
    rope0_ptr,
    idx0_ptr,
    kv1_ptr,
    ks1_ptr,
    rope1_ptr,
    idx1_ptr,
    sink_ptr,
    out_ptr,
    lse_ptr,
    part_ptr,
    part_ml_ptr,
    ws_ptr,
    T,
    H,
    D,
    K0,
    K1,
    S0,
    S1,
    SS0,
    SS1,
    SR0,
    SR1,
    N,
    scale,
    QUANT: tl.constexpr,
    BF16_DOT: tl.constexpr,
    DP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    DS: tl.constexpr = BLOCK_D if BLOCK_D < DP else DP
    head_tiles = tl.cdiv(H, BLOCK_H)
    # Chunks of whole tiles, so only the last chunk of a pool has a ragged tile.
    chunk0 = tl.cdiv(tl.cdiv(K0, SPLITS), BLOCK_N) * BLOCK_N
    chunk1 = tl.cdiv(tl.cdiv(K1, SPLITS), BLOCK_N) * BLOCK_N
    # The program's workspace: a row of scores per head, each pool's slots padded to whole tiles, so every
    # tile is stored and loaded without a mask.
    width0 = tl.cdiv(K0, BLOCK_N) * BLOCK_N
    width = width0 + tl.cdiv(K1, BLOCK_N) * BLOCK_N
    ws = ws_ptr + (tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H))[:, None] * width
    for task in range(tl.program_id(0), T * head_tiles * SPLITS, tl.num_programs(0)):
        split = task % SPLITS
        t = task // SPLITS // head_tiles
        h = (task // SPLITS % head_tiles) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = h < H
        rows = t * H + h
        lo0 = split * chunk0
        hi0 = tl.minimum(lo0 + chunk0, K0)
        lo1 = split * chunk1
        hi1 = tl.minimum(lo1 + chunk1, K1)
        idx0 = idx0_ptr + t * K0
        idx1 = idx1_ptr + t * K1
        m = tl.full([BLOCK_H], _NEG, tl.float32)
        total = tl.zeros([BLOCK_H], dtype=tl.float32)
        n0 = tl.cdiv(tl.maximum(hi0 - lo0, 0), BLOCK_N)
        n_tiles = n0 + tl.cdiv(tl.maximum(hi1 - lo1, 0), BLOCK_N)
        tl.debug_barrier()  # the previous task has read the workspace
        # Pass 1: the scores of each key tile, contracted over slices of DS channels (the query in its
        # natural layout), to the workspace; the running max and sum of exponentials.
        for i in range(0, n_tiles):
            first, valid, row, page, col = _tile(i, n0, lo0, hi0, idx0, lo1, hi1, idx1, width0, BLOCK_N)
            s = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
            for d0 in range(0, D, DS):
                d = d0 + tl.arange(0, DS)
                q_mask = h_ok[:, None] & (d < D)[None, :]
                q = _operand(
                    tl.load(q_ptr + rows[:, None] * D + d[None, :], mask=q_mask, other=0.0), BF16_DOT
                )
                # triton-ascend 3.2 takes no starred arguments: both pools' pointers spelled out.
                k = _tile_rows(first, page,
                               kv0_ptr, ks0_ptr, rope0_ptr, S0, SS0, SR0, kv1_ptr, ks1_ptr, rope1_ptr, S1,
                               SS1, SR1, row, valid, d, D, N, QUANT, DP, BF16_DOT)  # fmt: skip
                # ieee: the tf32 default on GPUs would cost ~1e-3 relative error in fp32 attention.
                s = tl.dot(q, tl.trans(k), s, input_precision="ieee")
            s = tl.where(valid[None, :], s * scale, _NEG)
            tl.store(ws + col[None, :], s)
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.where(valid[None, :], tl.exp(s - m_new[:, None]), 0.0)
            total = total * tl.exp(m - m_new) + tl.sum(p, axis=1)
            m = m_new
        tl.debug_barrier()  # the scores are written before any lane reads them
        sink = tl.load(sink_ptr + h, mask=h_ok, other=0.0)
        # Partials split-major ([SPLITS, T * H] rows; the sums after all the maxima), so a head tile's
        # maxima and sums are contiguous: written with a stride (interleaved, or token-major), BiSheng lays
        # out the [BLOCK_H] vectors of the epilogue with their elements padded to 32 bytes and overflows UB.
        part = split * T * H + rows
        # Pass 2, a slice of DS output channels at a time: acc += exp(s - m) v with the final max m, so
        # nothing is rescaled. An invalid slot gathers a zero row: whatever its weight, it adds nothing (a
        # row without valid slot has m = _NEG and weights 1).
        for d0 in range(0, D, DS):
            d = d0 + tl.arange(0, DS)
            mask = h_ok[:, None] & (d < D)[None, :]
            acc = tl.zeros([BLOCK_H, DS], dtype=tl.float32)
            for i in range(0, n_tiles):
                first, valid, row, page, col = _tile(i, n0, lo0, hi0, idx0, lo1, hi1, idx1, width0, BLOCK_N)
                p = tl.exp(tl.load(ws + col[None, :]) - m[:, None])
                v = _tile_rows(first, page,
                               kv0_ptr, ks0_ptr, rope0_ptr, S0, SS0, SR0, kv1_ptr, ks1_ptr, rope1_ptr, S1,
                               SS1, SR1, row, valid, d, D, N, QUANT, DP, BF16_DOT)  # fmt: skip
                acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
            if SPLITS == 1:
                out = _finish(acc, m, total, sink).to(out_ptr.dtype.element_ty)
                tl.store(out_ptr + rows[:, None] * D + d[None, :], out, mask=mask)
            else:
                tl.store(part_ptr + part[:, None] * D + d[None, :], acc, mask=mask)
        if SPLITS == 1:
            tl.store(lse_ptr + rows, _lse(m, total), mask=h_ok)
        else:
            tl.store(part_ml_ptr + part, m, mask=h_ok)
            tl.store(part_ml_ptr + SPLITS * T * H + part, total, mask=h_ok)


@triton.jit(do_not_specialize=["T"])
def _merge_kernel(
    part_ptr,
    part_ml_ptr,
    sink_ptr,
    out_ptr,
    lse_ptr,
    T,
    H,
    D,
    n_splits,
    SP: tl.constexpr,
    DP: tl.constexpr,
):
    s = tl.arange(0, SP)
    s_ok = s < n_splits
    d = tl.arange(0, DP)
    d_ok = d < D
    for row in range(tl.program_id(0), T * H, tl.num_programs(0)):
        part = s * T * H + row
        m_s = tl.load(part_ml_ptr + part, mask=s_ok, other=_NEG)
        l_s = tl.load(part_ml_ptr + n_splits * T * H + part, mask=s_ok, other=0.0)
        acc_s = tl.load(
            part_ptr + part[:, None] * D + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0
        )
        m = tl.max(m_s, axis=0)
        w = tl.exp(m_s - m)
        acc = tl.sum(w[:, None] * acc_s, axis=0)[None, :]
        one = tl.zeros([1], dtype=tl.float32)  # the epilogue works on rows: a row of one head
        total = one + tl.sum(w * l_s, axis=0)
        out = _finish(acc, one + m, total, one + tl.load(sink_ptr + row % H))
        tl.store(out_ptr + row * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=d_ok[None, :])
        tl.store(lse_ptr + row + tl.arange(0, 1), _lse(one + m, total))


def sparse_attention_triton(
    q: torch.Tensor,
    pools: Sequence[KVPool],
    sink: torch.Tensor,
    scale: float,
    positions: torch.Tensor | None = None,
    inv_freq: torch.Tensor | None = None,
    split: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``split`` forces the decode (split + merge) or prefill path; by default ``decode_split`` decides."""
    t, h, d = q.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    lse = torch.empty((t, h), dtype=torch.float32, device=q.device)
    if t == 0:
        return out, lse
    (kv0, ks0, rope0, idx0), (kv1, ks1, rope1, idx1) = _pool_operands(pools, sink)
    block_h = head_tile(h)
    consts = {
        "QUANT": pools[0].quantized,
        # The interpreter stores bf16 as uint16: its bf16 dots are wrong.
        "BF16_DOT": q.dtype == torch.bfloat16 and not runtime.interpreter_active(),
        "DP": runtime.dot_dim(d),
        "BLOCK_H": block_h,
    }
    tasks = t * triton.cdiv(h, block_h)
    k0, k1 = idx0.shape[1], idx1.shape[1]
    # One workspace per program, as wide as the widest tiles of any config pad the slots to.
    width = triton.cdiv(k0, _MAX_BLOCK_N) * _MAX_BLOCK_N + triton.cdiv(k1, _MAX_BLOCK_N) * _MAX_BLOCK_N
    programs = runtime.grid(tasks * _MAX_SPLITS, uses_cube=True)[0]
    ws = torch.empty(max(1, programs * block_h * width), dtype=torch.float32, device=q.device)
    operands = (q, kv0, ks0, rope0, idx0, kv1, ks1, rope1, idx1, sink)
    strides = (kv0.stride(0), kv1.stride(0), ks0.stride(0), ks1.stride(0), rope0.stride(0), rope1.stride(0))
    sizes = (t, h, d, k0, k1, *strides, kv0.shape[1], scale)
    if split is None:
        split = decode_split(t, h)
    if not split:
        _prefill_tuned[_prefill_tuned.grid(tasks)](*operands, out, lse, out, lse, ws, *sizes, **consts)
    else:
        rows = t * h * _MAX_SPLITS
        part = torch.empty((rows, d), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((2, rows), dtype=torch.float32, device=q.device)
        chosen = _decode_tuned[lambda meta: _decode_tuned.grid(tasks * meta["SPLITS"])](
            *operands, out, lse, part, part_ml, ws, *sizes, **consts
        )
        _merge_tuned[_merge_tuned.grid(t * h)](
            part, part_ml, sink, out, lse, t, h, d, chosen.params["SPLITS"], SP=_MAX_SPLITS, DP=consts["DP"]
        )
    if inv_freq is not None:  # only the RoPE channels: a pass of their own keeps the attention tile small
        rotate_rope_channels_triton(out, positions, inv_freq, inverse=True)
    return out, lse


def head_tile(heads: int) -> int:
    """Heads per task: all of a token's up to ``MAX_HEAD_TILE``, at least the 16 ``tl.dot`` needs."""
    return min(MAX_HEAD_TILE, runtime.dot_dim(heads))


def decode_split(tokens: int, heads: int) -> bool:
    """Whether the (token, head tile) tasks are too few to fill the cores: split the slots instead."""
    return tokens * triton.cdiv(heads, head_tile(heads)) < runtime.num_aicore()


def _pool_operands(pools: Sequence[KVPool], sink: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], ...]:
    """(kv, scale, rope, indices) per pool, int32 indices; a missing second pool is the first with no slots.
    A pool is a column range of the cache buffer: its rows (and scales) are read at their stride, never
    copied."""
    ops = []
    for pool in pools:
        kv, rope = (t if t is None or t.stride(1) == 1 else t.contiguous() for t in (pool.kv, pool.rope))
        scale = sink if pool.scale is None else pool.scale  # never read for float pools
        rope = kv if rope is None else rope
        idx = pool.indices.to(torch.int32)
        # An empty pool has only -1 slots: it is given none, as the kernel reads row 0 for -1 slots.
        idx = idx[:, :0] if pool.kv.shape[0] == 0 else idx
        ops.append((kv, scale, rope, idx.contiguous()))
    if len(ops) == 1:
        kv, scale, rope, idx = ops[0]
        ops.append((kv, scale, rope, idx[:, :0].contiguous()))
    return tuple(ops)


# Footprints at D = 512 and the widest head tile: each pass loads a [BLOCK_N, BLOCK_D] key tile as a page
# of the window, by rows of the window or by rows of the compressed pool (6 buffers, one live), the query
# slice and the value accumulator [BLOCK_H, BLOCK_D], the stored and the loaded scores [BLOCK_H, BLOCK_N]
# with their masks. The IR estimates BLOCK_D = 128 or BLOCK_N = 128 at 325 and 331 KiB, over the buffer.
_DP = MAX_DIM
_MAX_SPLITS = 8


def _attn_ub(block_n: int, block_d: int) -> int:
    bh = MAX_HEAD_TILE
    return 4 * (6 * block_n * block_d + 2 * bh * block_d + 2 * bh * block_n) + 3 * bh * block_n


def _attn_configs(shapes: tuple[tuple[int, int, int], ...]) -> tuple[TuneConfig, ...]:
    return tuple(
        TuneConfig({"SPLITS": s, "BLOCK_N": bn, "BLOCK_D": bd}, _attn_ub(bn, bd), multibuffer=False)
        for s, bn, bd in shapes
    )


_PREFILL_CONFIGS = _attn_configs(((1, 64, 64),))
_DECODE_CONFIGS = _attn_configs(tuple((s, 64, 64) for s in (2, 4, _MAX_SPLITS)))
_MAX_BLOCK_N = max(c.params["BLOCK_N"] for c in (*_PREFILL_CONFIGS, *_DECODE_CONFIGS))
# The partial tile and its weighted copy [SP, DP], then the output row and its rotation temporaries.
_MERGE_CONFIGS = (TuneConfig({}, 4 * (2 * _MAX_SPLITS * _DP + 8 * _DP)),)


def _attn_signature(q: str, kv0: str, kv1: str) -> dict[str, str]:
    # Quantised pools: int8 codes, RoPE channels in the compute dtype (q's); float pools pass kv as rope.
    rope0, rope1 = (q, q) if kv0 == "*i8" else (kv0, kv1)
    return {
        "q_ptr": q,
        **{"kv0_ptr": kv0, "ks0_ptr": "*fp32", "rope0_ptr": rope0, "idx0_ptr": "*i32"},
        **{"kv1_ptr": kv1, "ks1_ptr": "*fp32", "rope1_ptr": rope1},
        "idx1_ptr": "*i32",
        "sink_ptr": "*fp32",
        "out_ptr": q,
        "lse_ptr": "*fp32",
        "part_ptr": "*fp32",
        "part_ml_ptr": "*fp32",
        "ws_ptr": "*fp32",
        **dict.fromkeys(("T", "H", "D", "K0", "K1", "S0", "S1", "SS0", "SS1", "SR0", "SR1", "N"), "i32"),
        "scale": "fp32",
    }


# (QUANT, BF16_DOT) -> the (q, window kv, compressed kv) dtypes a device launches with it (bf16 q: bf16 dots).
_VARIANTS = {
    (0, 0): (("*fp32", "*fp32", "*fp32"), ("*fp32", "*bf16", "*bf16")),
    (0, 1): (("*bf16", "*bf16", "*bf16"), ("*bf16", "*bf16", "*fp32")),  # the model's fp32 compressed entries
    (1, 0): (("*fp32", "*i8", "*i8"),),
    (1, 1): (("*bf16", "*i8", "*i8"),),
}


def _merge_signature(out: str) -> dict[str, str]:
    return {
        **dict.fromkeys(("part_ptr", "part_ml_ptr", "sink_ptr"), "*fp32"),
        "out_ptr": out,
        "lse_ptr": "*fp32",
        **dict.fromkeys(("T", "H", "D", "n_splits"), "i32"),
    }


_ATTN_VARIANTS = tuple(
    Variant(
        {"QUANT": quant, "BF16_DOT": bf16, "DP": _DP, "BLOCK_H": MAX_HEAD_TILE},
        tuple(_attn_signature(*d) for d in dtypes),
    )
    for (quant, bf16), dtypes in _VARIANTS.items()
)
_prefill_tuned = tuning.TunedKernel(
    _sparse_attn_kernel, _PREFILL_CONFIGS, ["H", "D"], "prefill", variants=_ATTN_VARIANTS, uses_cube=True
)
# Decode is tuned per batch size too (T in the key): the best split of a decode batch depends on its size.
_decode_tuned = tuning.TunedKernel(
    _sparse_attn_kernel, _DECODE_CONFIGS, ["T", "H", "D"], "decode", variants=_ATTN_VARIANTS, uses_cube=True
)
_merge_tuned = tuning.TunedKernel(
    _merge_kernel,
    _MERGE_CONFIGS,
    key=["D"],
    variants=(
        Variant({"SP": _MAX_SPLITS, "DP": _DP}, (_merge_signature("*fp32"), _merge_signature("*bf16"))),
    ),
)
KERNELS = (_prefill_tuned, _decode_tuned, _merge_tuned)
