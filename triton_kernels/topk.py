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
    ``_select_row`` (shared with the fused indexer) selects in one program per row, without a sort:
    scores map to order-preserving int32 keys; four passes of an 8-bit histogram (``tl.histogram``)
    over the keys still tied with the threshold prefix narrow down the k-th largest key, stopping as
    soon as a whole bin is taken; a last pass emits, in position order, every key above the threshold
    and the first keys equal to it, so the output is sorted without sorting. Emission compacts with a
    prefix sum and a masked scattered store (the one scatter the compaction needs).
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
def _order_key(x):
    """int32 keys ordered like the fp32 scores (negative floats have their magnitude bits flipped)."""
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return tl.where(x == 0.0, 0, key)  # -0.0 and +0.0 tie


@triton.jit
def _pick_bin(hist, need):
    """The highest bin whose suffix count reaches ``need``; returns (bin, its count, need left inside it)."""
    bins = tl.arange(0, 256)
    at_or_above = tl.sum(hist) - tl.cumsum(hist, axis=0) + hist
    b = tl.sum((at_or_above >= need).to(tl.int32)) - 1
    count = tl.sum(tl.where(bins == b, hist, 0))
    above = tl.sum(tl.where(bins > b, hist, 0))
    return b, count, need - above


@triton.jit
def _select_row(src, n, k, out, pos_map, MAP_BLOCK: tl.constexpr, BLOCK_S: tl.constexpr):
    """Top-k of ``src[0:n]`` into ``out[0:k]`` (see the module contract).

    Element ``i`` is reported as position ``i``, or with ``MAP_BLOCK > 0`` as
    ``pos_map[i // MAP_BLOCK] * MAP_BLOCK + i % MAP_BLOCK`` (slots of candidate blocks).
    """
    offs = tl.arange(0, BLOCK_S)
    hist = tl.zeros([256], dtype=tl.int32)
    skipped = 0
    for i0 in range(0, n, BLOCK_S):
        x = tl.load(src + i0 + offs, mask=i0 + offs < n, other=float("-inf"))
        live = x > float("-inf")
        # tl.histogram of triton-ascend 3.2 takes no mask: dead lanes count in bin 0 and are taken out.
        hist += tl.histogram(tl.where(live, (_order_key(x) >> 24) + 128, 0), 256)
        skipped += BLOCK_S - tl.sum(live.to(tl.int32))
    hist -= tl.where(tl.arange(0, 256) == 0, skipped, 0)
    n_sel = tl.minimum(k, tl.sum(hist))
    b, count, need = _pick_bin(hist, n_sel)
    prefix = b - 128
    thr = prefix << 24
    # Refine while only part of the threshold bin is taken: 8 more key bits per pass.
    for p in tl.static_range(1, 4):
        shift = 24 - 8 * p
        if need < count:
            hist = tl.zeros([256], dtype=tl.int32)
            skipped = 0
            for i0 in range(0, n, BLOCK_S):
                x = tl.load(src + i0 + offs, mask=i0 + offs < n, other=float("-inf"))
                key = _order_key(x)
                live = (x > float("-inf")) & ((key >> (shift + 8)) == prefix)
                hist += tl.histogram(tl.where(live, (key >> shift) & 255, 0), 256)
                skipped += BLOCK_S - tl.sum(live.to(tl.int32))
            hist -= tl.where(tl.arange(0, 256) == 0, skipped, 0)
            b, count, need = _pick_bin(hist, need)
            prefix = prefix * 256 + b
            thr = prefix << shift
    # Keys above thr are all taken, and the first `need` keys equal to it (lower positions win ties).
    thr = tl.where(n_sel > 0, thr, 2147483647)  # nothing to take: no key is above the largest
    taken = 0
    ties = 0
    for i0 in range(0, n, BLOCK_S):
        i = i0 + offs
        x = tl.load(src + i, mask=i < n, other=float("-inf"))
        key = _order_key(x)
        live = x > float("-inf")
        tie = live & (key == thr)
        tie_rank = ties + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        sel = live & ((key > thr) | (tie & (tie_rank < need)))
        picked = tl.sum(sel.to(tl.int32))
        # Most tiles of a long row pick nothing. A picking tile stores densely: slot taken + q gets the q-th
        # selected lane (an fp32 sort of the lane ids puts them first). A scattered masked store would
        # become a read-modify-write of every lane on Ascend, racing with the lanes that share its slot.
        if picked > 0:
            q_ok = offs < picked
            lane = tl.sort(tl.where(sel, offs, BLOCK_S).to(tl.float32)).to(tl.int32)
            chosen = i0 + tl.where(q_ok, lane, 0)  # a live position for every lane
            if MAP_BLOCK > 0:
                block = tl.load(pos_map + chosen // MAP_BLOCK, mask=q_ok, other=0)  # in-bounds: chosen < n
                pos = block * MAP_BLOCK + chosen % MAP_BLOCK
            else:
                pos = chosen
            tl.store(out + taken + offs, pos, mask=q_ok)
        taken += picked
        ties += tl.sum(tie.to(tl.int32))
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
    # Per selection tile: the loaded scores, keys, masks, two prefix sums, digits, positions
    # (about ten [BLOCK_S] 4-byte tiles), plus the histogram and its suffix sums.
    return 4 * (10 * block_s + 4 * 256)


_CONFIGS = tuple(TuneConfig({"BLOCK_S": bs}, select_ub(bs)) for bs in (512, 1024, 2048))

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
