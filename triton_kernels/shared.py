"""Device helpers the op kernels share, each in one place: tile loads whose every lane addresses its
tensor (``gather_rows``), int8 quantisation of rows, the RMS factor of a row, the rotation of RoPE pairs,
and the exact top-k selection of a row (``select_row``) with the block maxima of two-level TopK.

Tile loads: Triton-Ascend 3.2.0's adapter turns a masked access whose mask it cannot prove rectangular (a
gather through clamped or ``-1`` row ids is one) into an unmasked access plus a select: masked-out lanes
are really read, and an address outside the tensor faults the device. Kernels therefore clamp indices
before forming an address and keep the mask for the values; a line doing so ends with
``# in-bounds: <why>`` (see docs/ascend-gate.md, which also says how the gate and the interpreter tests
check it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TINY = tl.constexpr(1e-30)  # divides an all-zero row without producing NaN (its quotient is 0 anyway)
_BITS = 2  # key bits a threshold pass fixes: FAN candidates counted at once, a [BLOCK_S, FAN] compare
_FAN = 1 << _BITS
BITS, FAN = tl.constexpr(_BITS), tl.constexpr(_FAN)


def take_rows(table: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """``table[at]`` for row ids ``at`` of any shape, as the references gather: one ``index_select``,
    which on the CPU takes a fraction of the time of advanced indexing."""
    return table.index_select(0, at.flatten()).view(*at.shape, *table.shape[1:])


@triton.jit
def gather_rows(base, rows, valid, cols, width, stride, inside):
    """The ``[rows, cols]`` tile of a ``[*, width]`` tensor of row stride ``stride`` (a column range of a
    wider buffer, as a KV pool is, needs no copy), 0 where not ``valid`` or past width.

    ``rows`` must be row ids of the tensor for every lane (clamp them first). ``inside`` says every column
    is below ``width``: the columns then stay contiguous (one transfer per row); otherwise those past the
    end read column ``width - 1``.
    """
    ptrs = base + rows[:, None] * stride
    mask = valid[:, None] & (cols < width)[None, :]
    if inside:
        tile = tl.load(ptrs + cols[None, :], mask=mask, other=0)  # in-bounds: rows clamped by the caller
    else:
        last = tl.minimum(cols, width - 1)
        tile = tl.load(ptrs + last[None, :], mask=mask, other=0)  # in-bounds: rows and columns clamped
    return tile


@triton.jit
def quantize_rows(x):
    """fp32 rows ``x [R, D]`` as int8 codes (int32 values) and their scales ``[R]``: ``max |x| / 127`` per
    row, halves rounded away from zero (``quant.quantize_int8_ref``)."""
    scale = tl.max(tl.abs(x), axis=1) / 127
    y = x / tl.maximum(scale, TINY)[:, None]
    # fp32 -> int32 truncates toward zero: adding 0.5 to |y| rounds halves away from zero.
    r = tl.minimum((tl.abs(y) + 0.5).to(tl.int32), 127)
    return tl.where(y < 0, -r, r), scale


@triton.jit
def rms_factor(sum_sq, n, eps):
    """``rsqrt(mean(x**2) + eps)`` of a row of ``n`` values from their sum of squares: RMSNorm's factor."""
    return 1.0 / tl.sqrt(sum_sq / n + eps)


@triton.jit
def turn_pairs(even, odd, cos, sin):
    """The pairs ``(even, odd)`` turned by the angles of ``cos`` / ``sin``, as ``[..., 2]`` (the pair axis
    last), in fp32 as transformers' RoPE computes them."""
    return tl.join(even * cos - odd * sin, odd * cos + even * sin)


@triton.jit
def rotate_pairs(x, cos, sin):
    """The pairs ``(2i, 2i + 1)`` of rows ``x [R, 2H]`` turned by the angles of ``cos`` / ``sin``
    (``[R, H]`` or ``[1, H]``)."""
    rows: tl.constexpr = x.shape[0]
    half: tl.constexpr = x.shape[1] // 2
    even, odd = tl.split(tl.reshape(x, [rows, half, 2]))
    return tl.reshape(turn_pairs(even, odd, cos, sin), [rows, 2 * half])


@triton.jit
def _from_order_key(key):
    """The fp32 scores whose int32 order keys (ordered like the scores: negative floats have their
    magnitude bits flipped, a flip that is its own inverse) are ``key``; keys below the lowest finite
    score's (NaN patterns) are raised to it."""
    key = tl.maximum(key, -2139095040)  # the key of -FLT_MAX
    bits = key ^ ((key >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _row_tile(src, i0, n, BLOCK_S: tl.constexpr):
    """``src[i0 : i0 + BLOCK_S]``, ``-inf`` from ``n`` on (a range mask: Ascend keeps it on the copy)."""
    offs = tl.arange(0, BLOCK_S)
    return tl.load(src + i0 + offs, mask=offs < n - i0, other=float("-inf"))


@triton.jit
def _count_at_least(src, n, thr, BLOCK_S: tl.constexpr):
    """``[FAN]``: how many of ``src[0:n]`` are ``>= thr[j]``, with fp32 compares and sums."""
    count = tl.zeros([FAN], dtype=tl.int32)
    for i0 in range(0, n, BLOCK_S):
        x = _row_tile(src, i0, n, BLOCK_S)
        count += tl.sum((x[:, None] >= thr[None, :]).to(tl.int32), axis=0)
    return count


@triton.jit
def select_row(src, n, k, out, pos_map, MAP_BLOCK: tl.constexpr, BLOCK_S: tl.constexpr):
    """Top-k of ``src[0:n]`` into ``out[0:k]`` (``topk``'s contract: positions ascending, ties to the lower
    one, ``-1`` padded).

    Element ``i`` is reported as position ``i``, or with ``MAP_BLOCK > 0`` as
    ``pos_map[i // MAP_BLOCK] * MAP_BLOCK + i % MAP_BLOCK`` (slots of candidate blocks).
    """
    offs = tl.arange(0, BLOCK_S)
    lane = offs.to(tl.float32)
    fan = tl.arange(0, FAN)
    # Threshold search over the order keys, BITS bits a pass: the largest key whose score n_sel scores
    # reach is the n_sel-th largest score. The first pass's lowest candidate counts the live scores; a
    # pass stops the search at a key that exactly n_sel scores reach (all of them are taken, ties too).
    key = -2147483648
    n_sel = 0
    exact = n_sel != 0  # False, as the i1 tensor the loop reassigns
    for p in range(32 // BITS):
        if exact == 0:
            cand = key + (fan << (32 - BITS * (p + 1)))  # wraps like the unsigned keys it stands for
            counts = _count_at_least(src, n, _from_order_key(cand), BLOCK_S)
            n_sel = tl.where(p == 0, tl.minimum(k, tl.sum(tl.where(fan == 0, counts, 0))), n_sel)
            pick = tl.sum((counts.to(tl.float32) >= n_sel.to(tl.float32)).to(tl.int32)) - 1
            key = tl.sum(tl.where(fan == pick, cand, 0))
            exact = tl.sum(tl.where(fan == pick, counts, 0)) == n_sel
    thr = _from_order_key(key)
    # Short of an exact key: the scores above the n_sel-th and the first ties (the lower position wins).
    above = _count_at_least(src, n, _from_order_key(key + 1 + fan * 0), BLOCK_S)
    need = tl.where(exact, 0, n_sel - tl.sum(tl.where(fan == 0, above, 0)))
    taken = 0
    for i0 in range(0, n, BLOCK_S):
        x = _row_tile(src, i0, n, BLOCK_S)
        tie = (x == thr) & (exact == 0)
        n_tie = tl.sum(tie.to(tl.int32))
        cutoff = BLOCK_S - 1.0  # lane of the last tie taken here
        if n_tie > need:
            tie_lanes = tl.sort(tl.where(tie, lane, BLOCK_S))
            cutoff = tl.max(tl.where(lane < need.to(tl.float32), tie_lanes, -1.0))
        # An exact key counts no ties, so the cut stays past the tile and every score equal to it is taken.
        sel = ((x > thr) | ((x == thr) & (lane <= cutoff))) & (n_sel > 0)
        need -= tl.minimum(n_tie, need)
        picked = tl.sum(sel.to(tl.int32))
        # Most tiles of a long row pick nothing. A picking tile stores densely: slot taken + q gets the q-th
        # selected lane (an fp32 sort of the lane ids puts them first). A scattered masked store would
        # become a read-modify-write of every lane on Ascend, racing with the lanes that share its slot.
        if picked > 0:
            q_ok = offs < picked
            first = tl.sort(tl.where(sel, lane, BLOCK_S)).to(tl.int32)
            chosen = i0 + tl.where(q_ok, first, 0)  # a live position for every lane
            if MAP_BLOCK > 0:
                block = tl.load(pos_map + chosen // MAP_BLOCK, mask=q_ok, other=0)  # in-bounds: chosen < n
                pos = block * MAP_BLOCK + chosen % MAP_BLOCK
            else:
                pos = chosen
            tl.store(out + taken + offs, pos, mask=q_ok)
        taken += picked
    for j0 in range(0, k, BLOCK_S):
        j = j0 + offs
        tl.store(out + j, tl.full([BLOCK_S], -1, tl.int32), mask=(j >= n_sel) & (j < k))


@triton.jit
def block_maxima(row, visible, dst, CAND_BLOCK: tl.constexpr, BLOCK_S: tl.constexpr):
    """``dst[b]`` = max of ``row`` over the visible positions of block ``b``; the newest block ``+inf``."""
    BLOCKS: tl.constexpr = BLOCK_S // CAND_BLOCK
    n_blocks = tl.cdiv(visible, CAND_BLOCK)
    for b0 in range(0, n_blocks, BLOCKS):
        b = b0 + tl.arange(0, BLOCKS)
        # One 1-D load per tile: a [BLOCKS, CAND_BLOCK] mask `p < visible` is no rectangle for Ascend.
        p = b0 * CAND_BLOCK + tl.arange(0, BLOCK_S)
        tile = tl.reshape(tl.load(row + p, mask=p < visible, other=float("-inf")), [BLOCKS, CAND_BLOCK])
        m = tl.max(tile, axis=1)
        tl.store(dst + b, tl.where(b == n_blocks - 1, float("inf"), m), mask=b < n_blocks)
