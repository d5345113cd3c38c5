"""Sparse shared-KV attention with a per-head sink (model-spec §4.4; FlashMLA's sparse interface).

Contract
    ``sparse_attention(q [T, H, D], pools, sink [H] fp32, scale, positions=None, inv_freq=None)
    -> (out [T, H, D] dtype of q, lse [T, H] fp32)``. ``q`` is fp32 or bf16. ``pools`` holds one or
    two ``KVPool`` (the sliding window, then the compressed entries): a flat pool ``kv [num_slots, D]``
    (fp32 / bf16, or int8 with a per-slot ``scale [num_slots]`` fp32, the Ascend cache format; int8 for
    every pool or none) and each query's global slot ids ``indices [T, K]`` (int32 / int64, ``-1`` =
    invalid, ``K`` may differ per pool and be 0). Keys are the values. Over the valid slots of both
    pools, with ``s_j = scale * q_h . kv_j``: ``lse = log sum_j exp(s_j)`` (the sink excluded, as in
    FlashMLA; ``-inf`` for a row without valid slot) and ``out = sum_j exp(s_j - lse) kv_j *
    sigmoid(lse - sink_h)``, i.e. the softmax whose denominator also holds ``exp(sink_h)``; a row
    without valid slot gives zeros. ``sink_h`` is finite or ``-inf`` (plain softmax). With
    ``positions [T]`` and ``inv_freq [P]`` the output's last ``2P`` channels are de-rotated at each
    query's position (``apply_rope(..., inverse=True)``, a pass over those channels only); ``D`` is then
    even. int8 pools are compared against their dequantised reference (``kv * scale``).
    Limits: ``H <= MAX_HEADS``, ``D <= MAX_DIM``, every tensor under 2**31 elements (int32 offsets).

Kernels
    ``_sparse_attn_kernel``: one task is (token, ``BLOCK_H`` heads, split). The heads share the token's
    slots, so each gathered ``[BLOCK_N, D]`` key tile feeds transposed scores ``[BLOCK_N, D] x [D,
    BLOCK_H]`` and the value product ``[BLOCK_H, BLOCK_N] x [BLOCK_N, D]`` on the cube unit, with an
    online softmax whose running max starts at a finite sentinel (fully masked tiles never produce
    ``inf - inf``). Prefill (``SPLITS = 1``) normalises and adds the sink in the epilogue.
    Decode has too few (token, head block) tasks to fill the cores (``decode_split``): each pool's slot
    axis is cut into ``SPLITS`` chunks (autotuned), partial ``(max, sum, acc)`` go to a scratch buffer
    and ``_merge_kernel`` combines them by log-sum-exp, one (token, head) row per task. bf16 queries use
    bf16 dot operands on devices (fp32 accumulation); the interpreter, whose bf16 arithmetic is wrong,
    computes in fp32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from triton_kernels import runtime, tuning
from triton_kernels.quant import dequantize_int8
from triton_kernels.rope import apply_rope_ref, rotate_rope_channels_triton
from triton_kernels.safe_access import gather_rows, take_rows
from triton_kernels.spec import TuneConfig, Variant

MAX_HEADS = 128
MAX_DIM = 512
_Q_DTYPES = (torch.float32, torch.bfloat16)
_KV_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
_INDEX_DTYPES = (torch.int32, torch.int64)
_MAX_NUMEL = 2**31 - 1  # offsets are int32 inside the kernels
_NEG = tl.constexpr(-1.0e30)  # finite running-max sentinel
_MIN_BLOCK_H = 16  # tl.dot needs every dimension >= 16


@dataclass(frozen=True)
class KVPool:
    kv: torch.Tensor  # [num_slots, D] fp32 | bf16 | int8
    indices: torch.Tensor  # [T, K] int32 | int64: global slot ids, -1 = invalid
    scale: torch.Tensor | None = None  # [num_slots] fp32, int8 pools only


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
    quant = pools[0].kv.dtype == torch.int8
    for i, pool in enumerate(pools):
        kv, idx, kv_scale = pool.kv, pool.indices, pool.scale
        if (
            kv.dtype not in _KV_DTYPES
            or kv.dim() != 2
            or kv.shape[1] != d
            or (kv.dtype == torch.int8) != quant
        ):
            raise ValueError(
                f"pools[{i}].kv: {kv.dtype} {tuple(kv.shape)} must be [num_slots, {d}] of {_KV_DTYPES},"
                " int8 for every pool or for none"
            )
        if idx.dtype not in _INDEX_DTYPES or idx.dim() != 2 or idx.shape[0] != t:
            raise ValueError(
                f"pools[{i}].indices: {idx.dtype} {tuple(idx.shape)} must be [{t}, K] of {_INDEX_DTYPES}"
            )
        if (kv_scale is not None) != (kv.dtype == torch.int8):
            raise ValueError(f"pools[{i}].scale: must be given exactly when kv is int8 (kv is {kv.dtype})")
        if kv_scale is not None and (kv_scale.dtype != torch.float32 or kv_scale.shape != kv.shape[:1]):
            raise ValueError(
                f"pools[{i}].scale: {kv_scale.dtype} {tuple(kv_scale.shape)} must be float32 ({kv.shape[0]},)"
            )
        for name, x in (("kv", kv), ("indices", idx), ("scale", kv_scale)):
            if x is not None and x.device != q.device:
                raise ValueError(f"pools[{i}].{name}: device {x.device} differs from q's device {q.device}")
            if x is not None and x.numel() > _MAX_NUMEL:
                raise ValueError(f"pools[{i}].{name}: {x.numel()} elements exceeds the limit {_MAX_NUMEL}")
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
        kv = take_rows(pool.kv, slots)  # [T, K, D]: only the rows read, before any dequantisation
        gathered = kv.float() if pool.scale is None else dequantize_int8(kv, take_rows(pool.scale, slots))
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
def _attend(
    qt,
    m,
    total,
    acc,
    kv_ptr,
    ks_ptr,
    idx_ptr,
    lo,
    hi,
    D,
    stride,
    scale,
    QUANT: tl.constexpr,
    BF16_DOT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DP: tl.constexpr,
):
    """Online-softmax update of ``(max, sum of exponentials, acc)`` with the slots ``idx[lo:hi]`` of one pool.

    Scores are computed transposed, ``[BLOCK_N, BLOCK_H]`` from the transposed query ``qt [DP, BLOCK_H]``:
    the small probability tile is transposed for the value product, never the ``[BLOCK_N, DP]`` key tile.
    """
    d = tl.arange(0, DP)
    for j0 in range(lo, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        slot = tl.load(idx_ptr + j, mask=j < hi, other=-1)
        valid = slot >= 0
        row = tl.where(valid, slot, 0)  # -1 slots read row 0
        k = gather_rows(kv_ptr, row, valid, d, D, stride, D == DP)
        if BF16_DOT:
            k = k.to(tl.bfloat16)
        else:
            k = k.to(tl.float32)
        # ieee: the tf32 default on GPUs would cost ~1e-3 relative error in fp32 attention.
        s = tl.dot(k, qt, input_precision="ieee") * scale
        if QUANT:  # K = V = int8 * per-slot scale: the scale multiplies scores and probabilities
            ks = tl.load(ks_ptr + row, mask=valid, other=0.0)  # in-bounds: -1 slots read row 0
            s = s * ks[:, None]
        s = tl.where(valid[:, None], s, _NEG)
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.where(valid[:, None], tl.exp(s - m_new[None, :]), 0.0)
        total = total * alpha + tl.sum(p, axis=0)
        if QUANT:
            p = p * ks[:, None]
        acc = tl.dot(tl.trans(p).to(k.dtype), k, acc * alpha[:, None], input_precision="ieee")
        m = m_new
    return m, total, acc


@triton.jit
def _finish(acc, m, total, sink):
    """Output normalised by a denominator that holds the sink, and the lse of the scores alone."""
    top = tl.maximum(m, sink)
    keep = tl.exp(m - top)
    denom = total * keep + tl.exp(sink - top)  # 0 only with no valid slot and sink = -inf (acc is 0 then)
    out = acc * (keep / tl.where(denom > 0, denom, 1.0))[:, None]
    lse = tl.where(total > 0, m + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
    return out, lse


@triton.jit(do_not_specialize=["T", "K0", "K1"])
def _sparse_attn_kernel(
    q_ptr,
    kv0_ptr,
    ks0_ptr,
    idx0_ptr,
    kv1_ptr,
    ks1_ptr,
    idx1_ptr,
    sink_ptr,
    out_ptr,
    lse_ptr,
    part_ptr,
    part_ml_ptr,
    T,
    H,
    D,
    K0,
    K1,
    S0,
    S1,
    scale,
    QUANT: tl.constexpr,
    BF16_DOT: tl.constexpr,
    DP: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    head_blocks = tl.cdiv(H, BLOCK_H)
    # Chunks of whole tiles, so only the last chunk of a pool has a ragged tile.
    chunk0 = tl.cdiv(tl.cdiv(K0, SPLITS), BLOCK_N) * BLOCK_N
    chunk1 = tl.cdiv(tl.cdiv(K1, SPLITS), BLOCK_N) * BLOCK_N
    d = tl.arange(0, DP)
    d_ok = d < D
    for task in range(tl.program_id(0), T * head_blocks * SPLITS, tl.num_programs(0)):
        split = task % SPLITS
        t = task // SPLITS // head_blocks
        h = (task // SPLITS % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = h < H
        rows = t * H + h
        qt = tl.load(q_ptr + rows[None, :] * D + d[:, None], mask=d_ok[:, None] & h_ok[None, :], other=0.0)
        if BF16_DOT:
            qt = qt.to(tl.bfloat16)
        else:
            qt = qt.to(tl.float32)
        m = tl.full([BLOCK_H], _NEG, tl.float32)
        total = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, DP], dtype=tl.float32)
        lo0 = split * chunk0
        m, total, acc = _attend(
            qt,
            m,
            total,
            acc,
            kv0_ptr,
            ks0_ptr,
            idx0_ptr + t * K0,
            lo0,
            tl.minimum(lo0 + chunk0, K0),
            D,
            S0,
            scale,
            QUANT,
            BF16_DOT,
            BLOCK_N,
            DP,
        )
        lo1 = split * chunk1
        m, total, acc = _attend(
            qt,
            m,
            total,
            acc,
            kv1_ptr,
            ks1_ptr,
            idx1_ptr + t * K1,
            lo1,
            tl.minimum(lo1 + chunk1, K1),
            D,
            S1,
            scale,
            QUANT,
            BF16_DOT,
            BLOCK_N,
            DP,
        )
        if SPLITS == 1:
            out, lse = _finish(acc, m, total, tl.load(sink_ptr + h, mask=h_ok, other=0.0))
            mask = h_ok[:, None] & d_ok[None, :]
            tl.store(out_ptr + rows[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(lse_ptr + rows, lse, mask=h_ok)
        else:
            part = rows * SPLITS + split
            tl.store(part_ptr + part[:, None] * D + d[None, :], acc, mask=h_ok[:, None] & d_ok[None, :])
            tl.store(part_ml_ptr + 2 * part, m, mask=h_ok)
            tl.store(part_ml_ptr + 2 * part + 1, total, mask=h_ok)


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
        part = row * n_splits + s
        m_s = tl.load(part_ml_ptr + 2 * part, mask=s_ok, other=_NEG)
        l_s = tl.load(part_ml_ptr + 2 * part + 1, mask=s_ok, other=0.0)
        acc_s = tl.load(
            part_ptr + part[:, None] * D + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0
        )
        m = tl.max(m_s, axis=0)
        w = tl.exp(m_s - m)
        acc = tl.sum(w[:, None] * acc_s, axis=0)[None, :]
        one = tl.zeros([1], dtype=tl.float32)  # the epilogue works on rows: a row of one head
        out, lse = _finish(acc, one + m, one + tl.sum(w * l_s, axis=0), one + tl.load(sink_ptr + row % H))
        tl.store(out_ptr + row * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=d_ok[None, :])
        tl.store(lse_ptr + row + tl.arange(0, 1), lse)


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
    (kv0, ks0, idx0), (kv1, ks1, idx1) = _pool_operands(pools, sink)
    consts = {
        "QUANT": kv0.dtype == torch.int8,
        # The interpreter stores bf16 as uint16: its bf16 dots are wrong.
        "BF16_DOT": q.dtype == torch.bfloat16 and not runtime.interpreter_active(),
        "DP": _pad(d),
    }
    operands = (q, kv0, ks0, idx0, kv1, ks1, idx1, sink)
    sizes = (t, h, d, idx0.shape[1], idx1.shape[1], kv0.stride(0), kv1.stride(0), scale)
    if split is None:
        split = decode_split(t, h)
    if not split:
        _prefill_tuned[lambda meta: _prefill_tuned.grid(t * triton.cdiv(h, meta["BLOCK_H"]))](
            *operands, out, lse, out, lse, *sizes, **consts
        )
    else:
        rows = t * h * _MAX_SPLITS
        part = torch.empty((rows, d), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((rows, 2), dtype=torch.float32, device=q.device)
        chosen = _decode_tuned[
            lambda meta: _decode_tuned.grid(t * triton.cdiv(h, meta["BLOCK_H"]) * meta["SPLITS"])
        ](*operands, out, lse, part, part_ml, *sizes, **consts)
        _merge_tuned[_merge_tuned.grid(t * h)](
            part, part_ml, sink, out, lse, t, h, d, chosen.params["SPLITS"], SP=_MAX_SPLITS, DP=_pad(d)
        )
    if inv_freq is not None:  # only the RoPE channels: a pass of their own keeps the attention tile small
        rotate_rope_channels_triton(out, positions, inv_freq, inverse=True)
    return out, lse


def decode_split(tokens: int, heads: int) -> bool:
    """Whether the (token, head block) tasks are too few to fill the cores: split the slots instead."""
    return tokens * triton.cdiv(heads, _MIN_BLOCK_H) < runtime.num_aicore()


def _pool_operands(pools: Sequence[KVPool], sink: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], ...]:
    """(kv, scale, indices) per pool, int32 indices; a missing second pool is the first with no slots."""
    ops = []
    for pool in pools:
        scale = sink if pool.scale is None else pool.scale.contiguous()  # never read for float pools
        idx = pool.indices.to(torch.int32)
        # An empty pool has only -1 slots: it is given none, as the kernel reads row 0 for -1 slots.
        idx = idx[:, :0] if pool.kv.shape[0] == 0 else idx
        # A pool is a column range of the cache buffer: its rows are read at their stride, never copied.
        kv = pool.kv if pool.kv.stride(1) == 1 else pool.kv.contiguous()
        ops.append((kv, scale, idx.contiguous()))
    if len(ops) == 1:
        kv, scale, idx = ops[0]
        ops.append((kv, scale, idx[:, :0].contiguous()))
    return tuple(ops)


def _pad(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


# Footprints at D = 512: the transposed query and the accumulator [BLOCK_H, DP] fp32, a [BLOCK_N, DP] fp32
# key tile per pool loop (both counted, one is live), score, probability and mask tiles [BLOCK_N, BLOCK_H].
# Larger tiles do not fit the unified buffer at D = 512, even single-buffered; the output's de-rotation
# is a pass of its own (rope) as its even, odd and joined halves would add a quarter of the buffer.
_DP = MAX_DIM
_MAX_SPLITS = 8


def _attn_ub(block_h: int, block_n: int) -> int:
    return 4 * _DP * (2 * block_h + 2 * block_n) + 4 * 16 * block_h * block_n


def _attn_configs(shapes: tuple[tuple[int, int, int], ...]) -> tuple[TuneConfig, ...]:
    return tuple(
        TuneConfig({"SPLITS": s, "BLOCK_H": bh, "BLOCK_N": bn}, _attn_ub(bh, bn), multibuffer=False)
        for s, bh, bn in shapes
    )


_PREFILL_CONFIGS = _attn_configs(((1, _MIN_BLOCK_H, 16),))
_DECODE_CONFIGS = _attn_configs(tuple((s, _MIN_BLOCK_H, 16) for s in (2, 4, _MAX_SPLITS)))
# The partial tile and its weighted copy [SP, DP], then the output row and its rotation temporaries.
_MERGE_CONFIGS = (TuneConfig({}, 4 * (2 * _MAX_SPLITS * _DP + 8 * _DP)),)


def _attn_signature(q: str, kv0: str, kv1: str) -> dict[str, str]:
    pool = {"kv0_ptr": kv0, "ks0_ptr": "*fp32", "idx0_ptr": "*i32", "kv1_ptr": kv1, "ks1_ptr": "*fp32"}
    return {
        "q_ptr": q,
        **pool,
        "idx1_ptr": "*i32",
        "sink_ptr": "*fp32",
        "out_ptr": q,
        "lse_ptr": "*fp32",
        "part_ptr": "*fp32",
        "part_ml_ptr": "*fp32",
        **dict.fromkeys(("T", "H", "D", "K0", "K1", "S0", "S1"), "i32"),
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
    Variant({"QUANT": quant, "BF16_DOT": bf16, "DP": _DP}, tuple(_attn_signature(*d) for d in dtypes))
    for (quant, bf16), dtypes in _VARIANTS.items()
)
_prefill_tuned = tuning.TunedKernel(
    _sparse_attn_kernel, _PREFILL_CONFIGS, ["H", "D"], "prefill", variants=_ATTN_VARIANTS, uses_cube=True
)
# Decode batches come in the fixed sizes the engine captures graphs for: tuned per batch size.
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
