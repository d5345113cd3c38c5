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
    ``shared.select_row`` (the fused indexer's too) selects in one program per row, without a sort of
    the row and on the vector unit: no histogram, no prefix sum and no ordered integer compare beyond
    the range masks of its loads and stores (those run on Ascend's scalar unit). Scores map to
    order-preserving int32 keys; a threshold search fixes ``BITS`` key bits a pass, counting with fp32
    compares how many scores reach each of its ``FAN`` candidate thresholds, and stops at a threshold
    exactly ``k`` scores reach. A last pass emits, in position order, every score above the threshold
    and the first ties (a partial tile's tie lanes fp32-sorted to find the cut), so the output is
    sorted without sorting: a picking tile's lane ids are fp32-sorted and stored densely.
    ``_topk_kernel``: one task is a row. ``_candidate_kernel``: one task is a row; block maxima go to
    a per-program scratch row, then ``select_row`` picks the blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_kernels import runtime, tuning
from triton_kernels.limits import MAX_K, check_candidate_geometry, check_k
from triton_kernels.shared import FAN, block_maxima, select_row
from triton_kernels.spec import TuneConfig, Variant

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


def check_tensor(
    name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device
) -> None:
    if t.dtype != dtype or tuple(t.shape) != tuple(shape) or t.device != device:
        raise ValueError(
            f"{name}: {t.dtype} {tuple(t.shape)} on {t.device} must be {dtype} {tuple(shape)} on {device}"
        )


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
    return maxima.masked_fill(torch.arange(blocks, device=scores.device) == newest[:, None], float("inf"))


def candidate_blocks_ref(
    scores: torch.Tensor, visible: torch.Tensor, block_size: int, topk_blocks: int
) -> torch.Tensor:
    return topk_positions_ref(block_scores_ref(scores, visible, block_size), topk_blocks)


@triton.jit(do_not_specialize=["T"])
def _topk_kernel(s_ptr, out_ptr, T, N, stride_s, K, BLOCK_S: tl.constexpr):
    for t in range(tl.program_id(0), T, tl.num_programs(0)):
        select_row(s_ptr + t * stride_s, N, K, out_ptr + t * K, s_ptr, 0, BLOCK_S)


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
        block_maxima(s_ptr + t * stride_s, visible, blocks, CAND_BLOCK, BLOCK_S)
        tl.debug_barrier()  # block maxima are written before any lane reads them
        select_row(blocks, tl.cdiv(visible, CAND_BLOCK), KB, out_ptr + t * KB, blocks, 0, BLOCK_S)


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
    return 4 * (14 + FAN.value) * block_s


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
