"""Exact top-k positions by radix selection, and the candidate blocks of two-level TopK (model-spec §4.9).

Contract
    ``topk_positions(scores [T, N] fp32, k) -> [T, k] int32``: per row, the positions of the ``k``
    largest scores among those ``> -inf`` (``-inf`` = masked; ``+inf`` is an ordinary, largest
    score), sorted ascending and followed by ``-1`` where a row has fewer than ``k`` of them. Ties
    between equal scores go to the lower position (``-0.0`` equals ``+0.0``). Scores hold no NaN.
    ``0 <= k <= MAX_K``.

    ``candidate_blocks(scores [T, N] fp32, visible [T] int32, block_size, topk_blocks) -> [T,
    topk_blocks] int32``: level one of two-level TopK. Block ``b`` covers positions ``[b*block_size,
    (b+1)*block_size)``; its score is the max over its positions ``< visible[t]`` (``-inf`` when
    none). The block holding position ``visible[t] - 1`` (the newest) scores ``+inf``, so it is
    always kept and uses one of the slots. The result is ``topk_positions`` of the block scores:
    kept block ids ascending, ``-1`` padded; a block scoring ``-inf`` is never kept.

Kernels
    ``_select_row`` (shared with the fused indexer) selects in one program per row, without a sort of
    the row and on the vector unit: no histogram, no prefix sum and no ordered integer compare beyond
    the range masks of its loads and stores (those run on Ascend's scalar unit). Scores map to
    order-preserving int32 keys; a threshold search fixes ``BITS`` key bits a pass, counting with fp32
    compares how many scores reach each of its ``FAN`` candidate thresholds, and stops at a threshold
    exactly ``k`` scores reach. A last pass emits, in position order, every score above the threshold
    and the first ties (a partial tile's tie lanes fp32-sorted to find the cut), so the output is
    sorted without sorting: a picking tile's lane ids are fp32-sorted and stored densely.
    ``_topk_kernel``: one task is a row. ``_candidate_kernel``: one task is a row; block maxima go to
    a per-program scratch row, then ``_select_row`` picks the blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_kernels import runtime, tuning
from triton_kernels.spec import TuneConfig, Variant

MAX_K = 2048
MAX_CANDIDATE_BLOCK = 256  # positions per candidate block: one block-maximum tile holds whole blocks
_MAX_NUMEL = 2**31 - 1  # offsets are int32 inside the kernels
_BITS = 2  # key bits a threshold pass fixes: FAN candidates counted at once, a [BLOCK_S, FAN] compare
_FAN = 1 << _BITS
BITS, FAN = tl.constexpr(_BITS), tl.constexpr(_FAN)


def topk_positions(scores: torch.Tensor, k: int) -> torch.Tensor:
    _check_scores(scores)
    check_k("k", k, MAX_K)
    return topk_positions_triton(scores, k) if runtime.use_triton(scores) else topk_positions_ref(scores, k)


def candidate_blocks(
    scores: torch.Tensor, visible: torch.Tensor, block_size: int, topk_blocks: int
) -> torch.Tensor:
    _check_scores(scores)
    check_tensor("visible", visible, torch.int32, scores.shape[:1], scores.device)
    check_candidate_geometry(block_size, topk_blocks)
    if scores.shape[0] > 0 and runtime.check_ranges():
        low, high = (int(v) for v in torch.stack([visible.min(), visible.max()]).tolist())
        if low < 0 or high > scores.shape[1]:
            raise ValueError(f"visible: range [{low}, {high}] must lie in [0, {scores.shape[1]}] (N)")
    run = candidate_blocks_triton if runtime.use_triton(scores) else candidate_blocks_ref
    return run(scores, visible, block_size, topk_blocks)


def _check_scores(scores: torch.Tensor) -> None:
    if scores.dtype != torch.float32 or scores.dim() != 2:
        raise ValueError(f"scores: {scores.dtype} {tuple(scores.shape)} must be a 2-D torch.float32 tensor")
    if scores.numel() > _MAX_NUMEL:
        raise ValueError(f"scores: {scores.numel()} elements exceeds the limit {_MAX_NUMEL}")


def check_k(name: str, k: int, limit: int) -> None:
    if not 0 <= k <= limit:
        raise ValueError(f"{name}: {k} must be in [0, {limit}]")


def check_tensor(
    name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device
) -> None:
    if t.dtype != dtype or tuple(t.shape) != tuple(shape) or t.device != device:
        raise ValueError(
            f"{name}: {t.dtype} {tuple(t.shape)} on {t.device} must be {dtype} {tuple(shape)} on {device}"
        )


def check_candidate_geometry(block_size: int, topk_blocks: int) -> None:
    if block_size < 1 or block_size > MAX_CANDIDATE_BLOCK or block_size & (block_size - 1):
        raise ValueError(
            f"candidate block_size: {block_size} must be a power of two in [1, {MAX_CANDIDATE_BLOCK}]"
        )
    check_k("topk_blocks", topk_blocks, MAX_K)


def topk_positions_ref(scores: torch.Tensor, k: int) -> torch.Tensor:
    t, n = scores.shape
    canonical = scores + 0.0  # -0.0 ties with +0.0 (-0.0 + 0.0 is +0.0)
    kept = min(k, n)
    picked = torch.full((t, k), -1, dtype=torch.int32, device=scores.device)
    if not kept:
        return picked
    position = torch.arange(n, dtype=torch.int32, device=scores.device).expand(t, -1)

    def lowest(chosen: torch.Tensor) -> torch.Tensor:
        """The ``kept`` lowest positions where ``chosen``, ascending, ``n`` beyond the chosen ones."""
        return torch.where(chosen, position, n).topk(kept, dim=1, largest=False).values

    # Everything above the k-th largest score, then the lowest positions equal to it (the lower position
    # wins ties): ``topk`` finds the values, positions are picked by value (its order among ties is free).
    threshold = canonical.topk(kept, dim=1).values[:, -1:]
    above, tied = canonical > threshold, canonical == threshold
    room = kept - above.sum(dim=1, keepdim=True)
    last_tied = lowest(tied).gather(1, (room - 1).clamp(min=0))
    chosen = (above | (tied & (position <= last_tied) & (room > 0))) & (canonical > float("-inf"))
    first = lowest(chosen)
    picked[:, :kept] = torch.where(first < n, first, -1)
    return picked


def block_scores_ref(scores: torch.Tensor, visible: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[T, ceil(N / block_size)]``: max over the visible positions of each block, newest block ``+inf``."""
    t, n = scores.shape
    blocks = triton.cdiv(n, block_size)
    padded = scores.new_full((t, blocks * block_size), float("-inf"))
    hidden = torch.arange(n, device=scores.device) >= visible[:, None]
    padded[:, :n] = scores.masked_fill(hidden, float("-inf"))
    maxima = padded.view(t, blocks, block_size).amax(dim=-1)
    newest = (visible.long() - 1).div(block_size, rounding_mode="floor")  # -1 when nothing is visible
    rows = torch.nonzero(newest >= 0).flatten()
    maxima[rows, newest[rows]] = float("inf")
    return maxima


def candidate_blocks_ref(
    scores: torch.Tensor, visible: torch.Tensor, block_size: int, topk_blocks: int
) -> torch.Tensor:
    return topk_positions_ref(block_scores_ref(scores, visible, block_size), topk_blocks)


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
def _select_row(src, n, k, out, pos_map, MAP_BLOCK: tl.constexpr, BLOCK_S: tl.constexpr):
    """Top-k of ``src[0:n]`` into ``out[0:k]`` (see the module contract).

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
def _block_maxima(row, visible, dst, CAND_BLOCK: tl.constexpr, BLOCK_S: tl.constexpr):
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


@triton.jit(do_not_specialize=["T"])
def _topk_kernel(s_ptr, out_ptr, T, N, stride_s, K, BLOCK_S: tl.constexpr):
    for t in range(tl.program_id(0), T, tl.num_programs(0)):
        _select_row(s_ptr + t * stride_s, N, K, out_ptr + t * K, s_ptr, 0, BLOCK_S)


@triton.jit(do_not_specialize=["T"])
def _candidate_kernel(
    s_ptr,
    vis_ptr,
    scratch_ptr,
    out_ptr,
    T,
    stride_s,
    KB,
    CAND_BLOCK: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    pid = tl.program_id(0)
    stride_b = tl.cdiv(stride_s, CAND_BLOCK)
    blocks = scratch_ptr + pid * stride_b
    for t in range(pid, T, tl.num_programs(0)):
        visible = tl.load(vis_ptr + t)
        tl.debug_barrier()  # the previous row's selection has read the scratch row
        _block_maxima(s_ptr + t * stride_s, visible, blocks, CAND_BLOCK, BLOCK_S)
        tl.debug_barrier()  # block maxima are written before any lane reads them
        _select_row(blocks, tl.cdiv(visible, CAND_BLOCK), KB, out_ptr + t * KB, blocks, 0, BLOCK_S)


def topk_positions_triton(scores: torch.Tensor, k: int) -> torch.Tensor:
    t, n = scores.shape
    out = torch.empty((t, k), dtype=torch.int32, device=scores.device)
    if t > 0 and k > 0:
        if scores.stride(1) != 1:
            scores = scores.contiguous()
        _topk_tuned[_topk_tuned.grid(t)](scores, out, t, n, scores.stride(0), k)
    return out


def candidate_blocks_triton(
    scores: torch.Tensor, visible: torch.Tensor, block_size: int, topk_blocks: int
) -> torch.Tensor:
    t, n = scores.shape
    out = torch.empty((t, topk_blocks), dtype=torch.int32, device=scores.device)
    if t > 0 and topk_blocks > 0:
        scores = scores.contiguous()  # row stride n: the kernel sizes its scratch rows from it
        grid = _candidate_tuned.grid(t)
        scratch = torch.empty((grid[0], max(1, triton.cdiv(n, block_size))), device=scores.device)
        _candidate_tuned[grid](
            scores, visible.contiguous(), scratch, out, t, n, topk_blocks, CAND_BLOCK=block_size
        )
    return out


def select_ub(block_s: int) -> int:
    # Per selection tile: the loaded scores, lane ids, masks, the two lane sorts with their temporaries,
    # positions (about fourteen [BLOCK_S] 4-byte tiles), plus a threshold pass's [BLOCK_S, FAN] compares.
    return 4 * (14 + _FAN) * block_s


_CONFIGS = tuple(TuneConfig({"BLOCK_S": bs}, select_ub(bs)) for bs in (512, 1024))

_topk_tuned = tuning.TunedKernel(
    _topk_kernel,
    _CONFIGS,
    key=["K"],
    variants=(
        Variant(
            {},
            ({"s_ptr": "*fp32", "out_ptr": "*i32", "T": "i32", "N": "i32", "stride_s": "i32", "K": "i32"},),
        ),
    ),
)
_candidate_tuned = tuning.TunedKernel(
    _candidate_kernel,
    _CONFIGS,
    key=["KB", "CAND_BLOCK"],
    variants=(
        Variant(
            {"CAND_BLOCK": 8},
            (
                {
                    "s_ptr": "*fp32",
                    "vis_ptr": "*i32",
                    "scratch_ptr": "*fp32",
                    "out_ptr": "*i32",
                    "T": "i32",
                    "stride_s": "i32",
                    "KB": "i32",
                },
            ),
        ),
    ),
)
KERNELS = (_topk_tuned, _candidate_tuned)
