"""KV compressor: every ``ratio`` tokens of a request become one gated entry (model-spec §4.5, §4.7).

Layout
    A ragged batch of R requests. ``kv, gate [N, W]`` (fp32 / bf16) are the new tokens' projections
    ``wkv·x`` and ``wgate·x``; ``CompressBatch`` says whose they are: request r owns rows
    ``cu_seqlens[r] .. cu_seqlens[r+1]-1``, had seen ``start[r]`` tokens before (the position of its first
    new token) and keeps its state in row ``state_ids[r]`` (distinct) of the state pool; ``slots[i]`` is
    the pool slot of the entry that token i closes (ignored where no window closes, -1 = do not store).
    It also carries what the kernels read per token, derived once per batch by ``CompressBatch.build``
    (every compressor of a ratio in a step shares it): ``request[i]``, the request owning token i, and
    ``order``, the tokens as the entries kernel takes them (any permutation gives the same results).
    ``CompressorStates`` is that pool (fp32, updated in place): ``buffer_kv, buffer_gate [S, ratio-1, W]``
    hold the raw kv / gate of the open window (row j = token ``start - start % ratio + j``, valid for
    ``j < start % ratio``); with overlap, ``overlap_kv, overlap_gate [S, ratio, c]`` hold the Ca halves of
    the last closed window, the gate with ``ape`` added (valid once ``start >= ratio``).

Contract
    ``compress(kv, gate, batch, states, params, out, out_scale=None) -> None``. Window g covers the
    positions ``g·r .. g·r+r-1``; with ``z_t = gate_t + ape[t mod r]`` (no ``ape``: ``z_t = gate_t``):
    without overlap (``W = c``), ``c_g = sum_j softmax_j(z_j) * kv_j`` per channel over the window;
    with overlap (V4 ratio 4, ``W = 2c``) the softmax runs over ``2r`` slots: the Ca halves (channels
    ``[0, c)``) of window ``g-1`` (weight 0 for ``g = 0``), then the Cb halves (``[c, 2c)``) of window g;
    without gate (V4.1 ratio 1) ``c_g = kv_g``. The entry is ``RMSNorm(c_g) * norm_weight``, rotated on its
    last ``2P`` channels at position ``g·r`` when ``params.inv_freq`` is given (V4; V4.1 keeps the latent),
    written to ``out [num_slots, c]`` (fp32 / bf16, or int8 with ``out_scale [num_slots]`` as
    ``quant.quantize_int8``) at the slot of the token that closes window g. Then every request's state
    advances past its new tokens. ``states=None`` is the stateless pass (every ``start`` 0, nothing kept).
    Any split of a request's tokens over calls gives the same entries and final state.

Kernels
    ``_compress_kernel``: one task is a token, those that close a window first (so every program gets
    windows to pool, not only every r-th); a token that closes a window pools it with an online
    softmax per channel over ``BLOCK_S`` slots at a time (each slot read from the new rows, the buffered
    open window or the overlap slice: masked loads from each, never a pointer select), then norms,
    rotates (its pairs read back from a workspace row of the program's) and quantises the row and
    stores it. ``_compress_state_kernel``: one task is (request, ``BLOCK_C`` columns); it saves the Ca
    half of the last closed window, then the new open window. It runs after the entries kernel, which
    reads the old state.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakTensorKeyDictionary

from triton_kernels import runtime, tuning
from triton_kernels.quant import quantize_int8_ref
from triton_kernels.rmsnorm import rms_norm_ref
from triton_kernels.rope import apply_rope_ref
from triton_kernels.shared import quantize_rows, rms_factor, turn_pairs
from triton_kernels.spec import TuneConfig, Variant

MAX_DIM = 1024  # the entry row is held whole
_IN_DTYPES = (torch.float32, torch.bfloat16)
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
_MAX_NUMEL = 2**31 - 1  # offsets and positions are int32 inside the kernels
_NEG = tl.constexpr(-1.0e30)


@dataclass(frozen=True)
class CompressorParams:
    ratio: int
    overlap: bool  # V4 ratio 4: two overlapping windows per entry
    norm_weight: torch.Tensor  # [c] fp32
    eps: float
    ape: torch.Tensor | None = None  # [ratio, W] fp32 learned position bias of the gate (V4)
    inv_freq: torch.Tensor | None = None  # [P] fp32: rotate entries at their window's first position


@dataclass(frozen=True)
class CompressBatch:
    cu_seqlens: torch.Tensor  # [R + 1] int32
    start: torch.Tensor  # [R] int32
    state_ids: torch.Tensor  # [R] int32
    slots: torch.Tensor  # [N] int32
    request: torch.Tensor  # [N] int32: the request of each token
    order: torch.Tensor  # [N] int32: a permutation of the tokens, those that close a window first

    @classmethod
    def build(
        cls,
        ratio: int,
        cu_seqlens: torch.Tensor,
        start: torch.Tensor,
        state_ids: torch.Tensor,
        slots: torch.Tensor,
    ) -> CompressBatch:
        """The batch of compressors of ``ratio``, its per-token fields derived from the others."""
        n = slots.numel()
        reqs = torch.arange(start.numel(), dtype=torch.int32, device=slots.device)
        request = torch.repeat_interleave(reqs, cu_seqlens.diff(), output_size=n)
        positions = start[request] + torch.arange(n, device=slots.device) - cu_seqlens[request]
        closes = ((positions + 1) % ratio == 0) & (slots >= 0)
        return cls(cu_seqlens, start, state_ids, slots, request, closing_first(closes))

    @classmethod
    def single(cls, ratio: int, start: int, slots: torch.Tensor) -> CompressBatch:
        """One request, state row 0, whose new tokens are the rows of ``slots``."""
        meta = torch.tensor([0, slots.numel(), start, 0], dtype=torch.int32).to(slots.device)
        return cls.build(ratio, meta[:2], meta[2:3], meta[3:], slots)


def closing_first(closes: torch.Tensor) -> torch.Tensor:
    """The entries kernel's task order: the tokens that close a window first, each part in token order.
    Strided over the programs, every program gets its share of windows (in token order only every r-th
    program would, as the grid is a multiple of r)."""
    return torch.sort((~closes).to(torch.int32), stable=True).indices.to(torch.int32)


@dataclass
class CompressorStates:
    buffer_kv: torch.Tensor  # [S, ratio - 1, W] fp32
    buffer_gate: torch.Tensor  # [S, ratio - 1, W] fp32
    overlap_kv: torch.Tensor | None = None  # [S, ratio, c] fp32
    overlap_gate: torch.Tensor | None = None  # [S, ratio, c] fp32, ape included

    @classmethod
    def empty(
        cls, num_states: int, ratio: int, dim: int, overlap: bool, device: torch.device
    ) -> CompressorStates:
        def zeros(rows: int, width: int) -> torch.Tensor:
            return torch.zeros(num_states, rows, width, device=device)

        width = (2 if overlap else 1) * dim
        slices = (zeros(ratio, dim), zeros(ratio, dim)) if overlap else ()
        return cls(zeros(ratio - 1, width), zeros(ratio - 1, width), *slices)


def compress(
    kv: torch.Tensor,
    gate: torch.Tensor | None,
    batch: CompressBatch,
    states: CompressorStates | None,
    params: CompressorParams,
    out: torch.Tensor,
    out_scale: torch.Tensor | None = None,
) -> None:
    validate(kv, gate, batch, states, params, out, out_scale)
    compress_validated(kv, gate, batch, states, params, out, out_scale)


def compress_validated(
    kv: torch.Tensor,
    gate: torch.Tensor | None,
    batch: CompressBatch,
    states: CompressorStates | None,
    params: CompressorParams,
    out: torch.Tensor,
    out_scale: torch.Tensor | None = None,
) -> None:
    """``compress`` of arguments ``validate`` has passed: a graph's node, checked when it was recorded
    (a replay's tensors have the recorded shapes, dtypes and devices)."""
    run = compress_triton if runtime.use_triton(kv) else compress_ref
    run(kv, gate, batch, states, params, out, out_scale)


def validate(
    kv: torch.Tensor,
    gate: torch.Tensor | None,
    batch: CompressBatch,
    states: CompressorStates | None,
    params: CompressorParams,
    out: torch.Tensor,
    out_scale: torch.Tensor | None,
) -> None:
    r, c = params.ratio, params.norm_weight.numel()
    device = kv.device
    if r < 1 or (params.overlap and r < 2):
        raise ValueError(f"ratio: {r} must be >= 1 (>= 2 with overlap)")
    if params.norm_weight.dtype != torch.float32 or params.norm_weight.dim() != 1 or not 1 <= c <= MAX_DIM:
        raise ValueError(
            f"norm_weight: {params.norm_weight.dtype} {tuple(params.norm_weight.shape)} must be float32 [c],"
            f" 1 <= c <= {MAX_DIM}"
        )
    width = (2 if params.overlap else 1) * c
    if kv.dtype not in _IN_DTYPES or kv.dim() != 2 or kv.shape[1] != width:
        raise ValueError(f"kv: {kv.dtype} {tuple(kv.shape)} must be [N, {width}] of {_IN_DTYPES}")
    n = kv.shape[0]
    if (gate is None) != (r == 1):
        raise ValueError(f"gate: must be given exactly when ratio > 1 (ratio {r}: ratio 1 has no gate)")
    if gate is not None and (gate.shape != kv.shape or gate.dtype != kv.dtype):
        raise ValueError(
            f"gate: {gate.dtype} {tuple(gate.shape)} must equal kv's {kv.dtype} {tuple(kv.shape)}"
        )
    if params.ape is not None and (
        r == 1 or params.ape.dtype != torch.float32 or params.ape.shape != (r, width)
    ):
        raise ValueError(
            f"ape: {params.ape.dtype} {tuple(params.ape.shape)} must be float32 ({r}, {width}) (ratio > 1)"
        )
    if not params.eps > 0:
        raise ValueError(f"eps: {params.eps} must be > 0")
    freq = params.inv_freq
    if freq is not None and (
        freq.dtype != torch.float32 or freq.dim() != 1 or not 1 <= 2 * freq.numel() <= c or c % 2
    ):
        raise ValueError(
            f"inv_freq: {freq.dtype} {tuple(freq.shape)} must be float32 [P] with 2P <= c = {c}, c even"
        )
    if out.dtype not in _OUT_DTYPES or out.dim() != 2 or out.shape[1] != c:
        raise ValueError(f"out: {out.dtype} {tuple(out.shape)} must be [num_slots, {c}] of {_OUT_DTYPES}")
    if (out_scale is not None) != (out.dtype == torch.int8):
        raise ValueError(f"out_scale: must be given exactly when out is int8 (out is {out.dtype})")
    if out_scale is not None and (out_scale.dtype != torch.float32 or out_scale.shape != out.shape[:1]):
        raise ValueError(
            f"out_scale: {out_scale.dtype} {tuple(out_scale.shape)} must be float32 ({out.shape[0]},)"
        )
    reqs = batch.start.shape[0]
    for name, x, shape in (
        ("cu_seqlens", batch.cu_seqlens, (reqs + 1,)),
        ("start", batch.start, (reqs,)),
        ("state_ids", batch.state_ids, (reqs,)),
        ("slots", batch.slots, (n,)),
        ("request", batch.request, (n,)),
        ("order", batch.order, (n,)),
    ):
        if x.dtype != torch.int32 or x.shape != shape:
            raise ValueError(f"{name}: {x.dtype} {tuple(x.shape)} must be torch.int32 {shape}")
    if states is not None:
        shape = (states.buffer_kv.shape[0], r - 1, width)
        slices = (states.overlap_kv, states.overlap_gate)
        for name, x, want in (
            ("buffer_kv", states.buffer_kv, shape),
            ("buffer_gate", states.buffer_gate, shape),
            *(
                (name, x, (shape[0], r, c))
                for name, x in zip(("overlap_kv", "overlap_gate"), slices, strict=True)
            ),
        ):
            if (x is not None) != (name.startswith("buffer") or params.overlap):
                raise ValueError(f"{name}: the overlap slices are given exactly with overlap, buffers always")
            if x is not None and (x.dtype != torch.float32 or x.shape != want or not x.is_contiguous()):
                raise ValueError(
                    f"{name}: {x.dtype} {tuple(x.shape)} must be contiguous torch.float32 {want}"
                )
    tensors = {"kv": kv, "gate": gate, "out": out, "out_scale": out_scale, **vars(params), **vars(batch)}
    tensors.update(vars(states) if states is not None else {})
    for name, x in tensors.items():
        if not isinstance(x, torch.Tensor):
            continue
        if x.device != device:
            raise ValueError(f"{name}: device {x.device} differs from kv's device {device}")
        if x.numel() > _MAX_NUMEL:
            raise ValueError(f"{name}: {x.numel()} elements exceeds the limit {_MAX_NUMEL}")
    if reqs and runtime.check_ranges():
        _check_ranges(batch, states, n, out.shape[0])


def _check_ranges(batch: CompressBatch, states: CompressorStates | None, n: int, num_slots: int) -> None:
    """Index ranges of the batch, read back from the device in one transfer."""
    cu, start, ids, slots = batch.cu_seqlens, batch.start, batch.state_ids, batch.slots
    ends = start.long() + cu.diff()
    sorted_ids = ids.sort().values
    stats = [cu[0], cu[-1], cu.diff().min(), start.min(), start.max(), ends.max(), ids.min(), ids.max()]
    # Token i's request owns rows cu[request[i]] .. cu[request[i] + 1] - 1.
    tokens, req = torch.arange(n, device=cu.device), batch.request.long()
    owner = req.clamp(0, len(start) - 1)
    stray = (req != owner) | (cu[owner] > tokens) | (cu[owner + 1] <= tokens)
    stats += [
        (sorted_ids[1:] == sorted_ids[:-1]).sum(),
        slots.min() if n else cu[0] - 1,
        slots.max() if n else cu[0] - 1,
        stray.sum(),
        (batch.order.sort().values != tokens).sum(),
    ]
    s = [int(v) for v in torch.stack([v.long() for v in stats]).tolist()]
    if s[0] != 0 or s[1] != n or s[2] < 0:
        raise ValueError(
            f"cu_seqlens: must rise from 0 to N = {n} (first {s[0]}, last {s[1]}, smallest step {s[2]})"
        )
    if s[3] < 0 or s[5] > _MAX_NUMEL:
        raise ValueError(f"start: range [{s[3]}, {s[4]}] must be >= 0 with every position below {_MAX_NUMEL}")
    if states is None and s[4] != 0:
        raise ValueError(f"start: {s[4]} needs a state (a stateless call starts every request at 0)")
    rows = states.buffer_kv.shape[0] if states is not None else 1
    if states is not None and (s[6] < 0 or s[7] >= rows or s[8]):
        raise ValueError(
            f"state_ids: range [{s[6]}, {s[7]}] with {s[8]} repeats must be distinct in [0, {rows})"
        )
    if s[9] < -1 or s[10] >= num_slots:
        raise ValueError(f"slots: range [{s[9]}, {s[10]}] must lie in [-1, {num_slots}) (out rows)")
    if s[11]:
        raise ValueError(f"request: {s[11]} tokens not of the request whose rows cu_seqlens gives them")
    if s[12]:
        raise ValueError(f"order: must be a permutation of the {n} tokens ({s[12]} places differ)")


def _ragged(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ``counts[i]`` items of each owner i, flat: every item's owner and its index among its owner's."""
    owner = np.repeat(np.arange(len(counts)), counts)
    return owner, np.arange(len(owner)) - (np.cumsum(counts) - counts)[owner]


@dataclass(frozen=True)
class _Windows:
    """Where the reference reads and writes for one batch and state layout: index bookkeeping only, the same
    for every compressor of the batch's ratio in a step (found once, ``_windows``)."""

    count: int  # G windows close
    rows: torch.Tensor  # [G * r] each window's rows in [new rows | held rows (state row-major)]
    kept: torch.Tensor  # the windows whose entry is stored...
    slots: torch.Tensor  # ... and its slot
    positions: torch.Tensor  # [G] each window's first position (its entry's rotation)
    staying: torch.Tensor | None  # with states: the new rows left in their request's open window...
    buffer_at: tuple[torch.Tensor, torch.Tensor] | None  # ... and their (state, row) in the buffers
    prev: torch.Tensor | None  # overlap: the Ca source of each window (see compress_ref)
    slice_at: tuple[torch.Tensor, torch.Tensor] | None  # overlap with states: (state, its last window)


# The windows of a batch, keyed by its cu_seqlens and checked against every field and its version (a field
# written in place makes them stale); one entry per (ratio, overlap, state rows). The fields are held weakly:
# an entry that held its key would never leave.
_WINDOWS: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def _windows(batch: CompressBatch, r: int, overlap: bool, state_rows: int | None) -> _Windows:
    fields = tuple(vars(batch).values())
    versions = tuple(t._version for t in fields)
    found = _WINDOWS.setdefault(batch.cu_seqlens, {})
    hit = found.get((r, overlap, state_rows))
    if hit is not None and hit[1] == versions and all(a() is b for a, b in zip(hit[0], fields, strict=True)):
        return hit[2]
    windows = _find_windows(batch, r, overlap, state_rows)
    found[r, overlap, state_rows] = (tuple(weakref.ref(t) for t in fields), versions, windows)
    return windows


def _find_windows(batch: CompressBatch, r: int, overlap: bool, state_rows: int | None) -> _Windows:
    # Index bookkeeping on the host, in numpy (a quarter of torch's time at these sizes: 69 vs 250 us for a
    # decode step of 8 requests). Every request at once: its sequence is its held rows then its new rows;
    # the rows of its closed windows are picked from the new and the held rows; its new rows past its last
    # closed window (its open window's) go to the buffer after the held ones, which stay in place.
    cu, start, sid, token_slots, req = (
        t.cpu().numpy().astype(np.int64)
        for t in (batch.cu_seqlens, batch.start, batch.state_ids, batch.slots, batch.request)
    )
    n = len(token_slots)
    held = start % r if state_rows is not None else np.zeros_like(start)
    windows, first = (held + np.diff(cu)) // r, start // r
    win_req, w = _ragged(windows)
    staying = buffer_at = prev = slice_at = None
    if state_rows is not None:
        j = held[req] + np.arange(n) - cu[req] - windows[req] * r  # the row's place in its open window
        staying = np.flatnonzero(j >= 0)
        buffer_at = (sid[req[staying]], j[staying])
    # Row of element k of request q's sequence: held row k of its state, or a new row.
    q, k = _ragged(windows * r)
    rows = np.where(k < held[q], n + sid[q] * (r - 1) + k, cu[q] + k - held[q])
    g = len(win_req)
    if overlap:
        # Slots [Ca of window g-1 | Cb of window g]: g-1 is the request's previous window of this call, or
        # its state's overlap slice; before window 0 the Ca slots weigh 0 (the row after the slices).
        prev = np.where(first[win_req] > 0, g + sid[win_req], g + (state_rows or 0))
        prev = np.where(w > 0, np.arange(-1, g - 1), prev)
        if state_rows is not None:
            closed = windows > 0
            slice_at = (sid[closed], np.cumsum(windows)[closed] - 1)
    number = first[win_req] + w
    # Window g closes at the token of position (g + 1) * r - 1.
    slots = token_slots[cu[win_req] + (number + 1) * r - 1 - start[win_req]]
    kept = np.flatnonzero(slots >= 0)

    def placed(*arrays: np.ndarray | None) -> list[torch.Tensor | None]:
        return [None if a is None else torch.from_numpy(a).to(batch.slots.device) for a in arrays]

    rows, kept, slots, positions, staying, prev = placed(rows, kept, slots[kept], number * r, staying, prev)
    buffer_at, slice_at = (None if pair is None else tuple(placed(*pair)) for pair in (buffer_at, slice_at))
    return _Windows(g, rows, kept, slots, positions, staying, buffer_at, prev, slice_at)


def compress_ref(
    kv: torch.Tensor,
    gate: torch.Tensor | None,
    batch: CompressBatch,
    states: CompressorStates | None,
    params: CompressorParams,
    out: torch.Tensor,
    out_scale: torch.Tensor | None = None,
) -> None:
    r, c = params.ratio, params.norm_weight.numel()
    at = _windows(batch, r, params.overlap, None if states is None else states.buffer_kv.shape[0])
    if at.count:  # copied only when a window closes: the copy is of every request's held rows
        stateless = (kv.float()[:0, None],) * 2
        held_kv, held_z = (states.buffer_kv, states.buffer_gate) if states is not None else stateless
        all_kv = torch.cat([kv.float(), held_kv.flatten(0, 1)])
        # No gate (ratio 1): one slot of weight 1.
        all_z = torch.cat([gate.float(), held_z.flatten(0, 1)]) if gate is not None else None
    if states is not None:
        states.buffer_kv[at.buffer_at] = kv.index_select(0, at.staying).float()
        if gate is not None:
            states.buffer_gate[at.buffer_at] = gate.index_select(0, at.staying).float()
    if not at.count:  # nothing closes: the overlap slices stay
        return
    win_kv = all_kv.index_select(0, at.rows).view(-1, r, all_kv.shape[1])
    win_z = all_z.index_select(0, at.rows).view_as(win_kv) if all_z is not None else torch.zeros_like(win_kv)
    if params.ape is not None:
        win_z = win_z + params.ape
    if params.overlap:
        slices = (states.overlap_kv, states.overlap_gate) if states is not None else ()
        prev_kv = torch.cat([win_kv[:, :, :c], *slices[:1], win_kv.new_zeros(1, r, c)])[at.prev]
        prev_z = torch.cat([win_z[:, :, :c], *slices[1:], win_z.new_full((1, r, c), float("-inf"))])[at.prev]
        if states is not None:
            state, last = at.slice_at
            states.overlap_kv[state], states.overlap_gate[state] = win_kv[last, :, :c], win_z[last, :, :c]
        win_kv = torch.cat([prev_kv, win_kv[:, :, c:]], dim=1)
        win_z = torch.cat([prev_z, win_z[:, :, c:]], dim=1)
    entries = rms_norm_ref((win_kv * win_z.softmax(dim=1)).sum(dim=1), params.norm_weight, params.eps)
    if params.inv_freq is not None:
        entries = apply_rope_ref(entries, at.positions, params.inv_freq)
    entries = entries.index_select(0, at.kept)
    if out_scale is not None:
        entries, scale = quantize_int8_ref(entries)
        out_scale[at.slots] = scale
    out[at.slots] = entries.to(out.dtype)


@triton.jit
def _rotate_row(y, ws, pos, freq_ptr, nope, P, CP: tl.constexpr):
    """The row ``y [CP]`` whose pairs ``(nope + 2i, nope + 2i + 1)``, ``i < P``, turn by ``pos·freq[i]``.

    ``nope`` is even, so every pair starts at an even channel; the other pairs turn by 0 (unchanged).
    The row goes through the program's workspace row ``ws [CP]`` and comes back as its even and its odd
    channels: split in registers (a reshape to pairs), BiSheng would lay out every tile the row is
    computed from, the pooling loop's included, with a last axis of 2 padded to 8 and overflow UB.
    """
    tl.debug_barrier()  # the previous task has read the workspace
    tl.store(ws + tl.arange(0, CP), y)
    tl.debug_barrier()
    h = tl.arange(0, CP // 2)
    even = tl.load(ws + 2 * h)
    odd = tl.load(ws + 2 * h + 1)
    i = h - nope // 2
    turns = (i >= 0) & (i < P)
    safe = tl.minimum(tl.maximum(i, 0), P - 1)
    angle = pos * tl.load(freq_ptr + safe, mask=turns, other=0.0)  # in-bounds: index clamped to [0, P)
    return tl.reshape(turn_pairs(even, odd, tl.cos(angle), tl.sin(angle)), [CP])


@triton.jit
def _token_rows(
    tok,
    ok,
    cols,
    col_ok,
    kv_ptr,
    gate_ptr,
    ape_ptr,
    bkv_ptr,
    bgate_ptr,
    first_row,
    start,
    sid,
    W,
    SX,
    R,
    ape_row,
    HAS_APE: tl.constexpr,
):
    """Raw kv and gate (plus ``ape``) of the tokens at positions ``tok`` and columns ``cols`` (2-D offsets);
    ``kv`` / ``gate`` rows ``SX`` apart, buffered and ``ape`` rows ``W``.

    A token at or after ``start`` is a new row; an earlier one of the open window is a buffered row.
    Rows that are neither (or not ``ok``) read as 0. ``ape_row`` is ``tok % R`` wherever ``tok >= 0``.
    """
    open_start = start - start % R
    new = (ok & (tok >= start))[:, None] & col_ok
    held = (ok & (tok < start) & (tok >= open_start))[:, None] & col_ok
    new_off = (first_row + tok - start)[:, None] * SX + cols
    held_off = (sid * (R - 1) + tok - open_start)[:, None] * W + cols
    x = tl.load(kv_ptr + new_off, mask=new, other=0.0).to(tl.float32)
    x += tl.load(bkv_ptr + held_off, mask=held, other=0.0)
    z = tl.load(gate_ptr + new_off, mask=new, other=0.0).to(tl.float32)
    z += tl.load(bgate_ptr + held_off, mask=held, other=0.0)
    if HAS_APE:
        # Ascend drops this mask. The row is the slot's (tok's is negative before the first window), as an
        # offset from a select would make the load a gather of single elements; the columns are clamped.
        ape_off = ape_row[:, None] * W + tl.minimum(cols, W - 1)
        z += tl.load(ape_ptr + ape_off, mask=new | held, other=0.0)  # in-bounds: row < R, columns clamped
    return x, z


@triton.jit
def _pool_window(
    g,
    first_row,
    start,
    sid,
    kv_ptr,
    gate_ptr,
    ape_ptr,
    bkv_ptr,
    bgate_ptr,
    okv_ptr,
    ogate_ptr,
    C,
    W,
    SX,
    R,
    OVERLAP: tl.constexpr,
    HAS_APE: tl.constexpr,
    CP: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Window g pooled per channel with the softmax of its gates, online over ``BLOCK_S`` slots at a time."""
    c = tl.arange(0, CP)
    c_ok = c < C
    m = tl.full([CP], _NEG, tl.float32)
    total = tl.zeros([CP], dtype=tl.float32)
    acc = tl.zeros([CP], dtype=tl.float32)
    n_slots = 2 * R if OVERLAP else R
    for k0 in range(0, n_slots, BLOCK_S):
        k = k0 + tl.arange(0, BLOCK_S)
        if OVERLAP:  # slot k < R: Ca half of token (g-1)R + k; slot k >= R: Cb half of token gR + k - R
            tok = (g - 1) * R + k
            cols = tl.where(k >= R, C, 0)[:, None] + c[None, :]
        else:
            tok = g * R + k
            cols = c[None, :]
        live = (k < n_slots) & (tok >= 0)
        x, z = _token_rows(
            tok,
            live,
            cols,
            c_ok[None, :],
            kv_ptr,
            gate_ptr,
            ape_ptr,
            bkv_ptr,
            bgate_ptr,
            first_row,
            start,
            sid,
            W,
            SX,
            R,
            k % R,
            HAS_APE,
        )
        if OVERLAP:  # the Ca half of the window closed before this call
            prior = (live & (tok < start - start % R))[:, None] & c_ok[None, :]
            off = (sid * R + k)[:, None] * C + c[None, :]
            x += tl.load(okv_ptr + off, mask=prior, other=0.0)
            z += tl.load(ogate_ptr + off, mask=prior, other=0.0)
        z = tl.where(live[:, None], z, _NEG)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        alpha = tl.exp(m - m_new)
        e = tl.where(live[:, None], tl.exp(z - m_new[None, :]), 0.0)
        total = total * alpha + tl.sum(e, axis=0)
        acc = acc * alpha + tl.sum(e * x, axis=0)
        m = m_new
    return acc / total


@triton.jit(do_not_specialize=["N"])
def _compress_kernel(
    kv_ptr,
    gate_ptr,
    ape_ptr,
    bkv_ptr,
    bgate_ptr,
    okv_ptr,
    ogate_ptr,
    norm_ptr,
    freq_ptr,
    req_ptr,
    order_ptr,
    cu_ptr,
    start_ptr,
    sid_ptr,
    slot_ptr,
    out_ptr,
    oscale_ptr,
    ws_ptr,
    N,
    C,
    W,
    SX,
    R,
    P,
    eps,
    OVERLAP: tl.constexpr,
    HAS_GATE: tl.constexpr,
    HAS_APE: tl.constexpr,
    ROPE: tl.constexpr,
    QUANT: tl.constexpr,
    CP: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    c = tl.arange(0, CP)
    c_ok = c < C
    weight = tl.load(norm_ptr + c, mask=c_ok, other=0.0)
    for task in range(tl.program_id(0), N, tl.num_programs(0)):
        i = tl.load(order_ptr + task)
        req = tl.load(req_ptr + i)
        start = tl.load(start_ptr + req)
        first_row = tl.load(cu_ptr + req)
        pos = start + i - first_row
        slot = tl.load(slot_ptr + i)
        if ((pos + 1) % R == 0) & (slot >= 0):  # token i closes window g
            g = (pos + 1) // R - 1
            if HAS_GATE:
                pooled = _pool_window(
                    g,
                    first_row,
                    start,
                    tl.load(sid_ptr + req),
                    kv_ptr,
                    gate_ptr,
                    ape_ptr,
                    bkv_ptr,
                    bgate_ptr,
                    okv_ptr,
                    ogate_ptr,
                    C,
                    W,
                    SX,
                    R,
                    OVERLAP,
                    HAS_APE,
                    CP,
                    BLOCK_S,
                )
            else:  # ratio 1: the entry is the token's own kv, normed
                pooled = tl.load(kv_ptr + i * SX + c, mask=c_ok, other=0.0).to(tl.float32)
            y = pooled * rms_factor(tl.sum(pooled * pooled, axis=0), C, eps) * weight
            if ROPE:
                ws = ws_ptr + tl.program_id(0) * CP
                y = _rotate_row(y, ws, (g * R).to(tl.float32), freq_ptr, C - 2 * P, P, CP)
            if QUANT:  # as quant.quantize_int8: the entry is one row
                codes, scale = quantize_rows(y[None, :])
                y = tl.reshape(codes, [CP])
                tl.store(oscale_ptr + slot, tl.max(scale, axis=0))  # the one row's scale
            tl.store(out_ptr + slot * C + c, y.to(out_ptr.dtype.element_ty), mask=c_ok)


@triton.jit(do_not_specialize=["n_req"])
def _compress_state_kernel(
    kv_ptr,
    gate_ptr,
    ape_ptr,
    bkv_ptr,
    bgate_ptr,
    okv_ptr,
    ogate_ptr,
    cu_ptr,
    start_ptr,
    sid_ptr,
    n_req,
    C,
    W,
    SX,
    R,
    OVERLAP: tl.constexpr,
    HAS_APE: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    col_blocks = tl.cdiv(W, BLOCK_C)
    for task in range(tl.program_id(0), n_req * col_blocks, tl.num_programs(0)):
        req = task // col_blocks
        cols = (task % col_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
        first_row = tl.load(cu_ptr + req)
        start = tl.load(start_ptr + req)
        sid = tl.load(sid_ptr + req)
        end = start + tl.load(cu_ptr + req + 1) - first_row
        new_open = end - end % R
        if OVERLAP:
            if new_open > start - start % R:  # a window closed: keep the Ca half of the last one
                ca = cols < C
                for k0 in range(0, R, BLOCK_S):
                    k = k0 + tl.arange(0, BLOCK_S)
                    x, z = _token_rows(
                        new_open - R + k,
                        k < R,
                        cols[None, :],
                        ca[None, :],
                        kv_ptr,
                        gate_ptr,
                        ape_ptr,
                        bkv_ptr,
                        bgate_ptr,
                        first_row,
                        start,
                        sid,
                        W,
                        SX,
                        R,
                        k % R,
                        HAS_APE,
                    )
                    off = (sid * R + k)[:, None] * C + cols[None, :]
                    mask = (k < R)[:, None] & ca[None, :]
                    tl.store(okv_ptr + off, x, mask=mask)
                    tl.store(ogate_ptr + off, z, mask=mask)
            tl.debug_barrier()  # the buffer rows just read are overwritten below
        # Rows of tokens buffered before this call stay where they are.
        first_new = tl.maximum(start, new_open) - new_open
        for s0 in range(first_new, end - new_open, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            mask = (s < end - new_open)[:, None] & (cols < W)[None, :]
            src = (first_row + new_open + s - start)[:, None] * SX + cols[None, :]
            dst = (sid * (R - 1) + s)[:, None] * W + cols[None, :]
            tl.store(bkv_ptr + dst, tl.load(kv_ptr + src, mask=mask).to(tl.float32), mask=mask)
            tl.store(bgate_ptr + dst, tl.load(gate_ptr + src, mask=mask).to(tl.float32), mask=mask)


def compress_triton(
    kv: torch.Tensor,
    gate: torch.Tensor | None,
    batch: CompressBatch,
    states: CompressorStates | None,
    params: CompressorParams,
    out: torch.Tensor,
    out_scale: torch.Tensor | None = None,
) -> None:
    n, width = kv.shape
    reqs = batch.start.shape[0]
    if n == 0:
        return
    r, c = params.ratio, params.norm_weight.numel()
    # Rows at one stride for both (the column ranges of one GEMM's output), columns contiguous.
    if kv.stride(1) != 1 or (gate is not None and (gate.stride(1) != 1 or gate.stride(0) != kv.stride(0))):
        kv, gate = kv.contiguous(), None if gate is None else gate.contiguous()
    dummy = params.norm_weight  # stands in for every pointer a variant never reads
    gate = kv if gate is None else gate
    ape = dummy if params.ape is None else params.ape.contiguous()
    bkv, bgate, okv, ogate = (
        (dummy if x is None else x for x in vars(states).values()) if states else [dummy] * 4
    )
    # states is None only with every start 0: no buffered row is ever read, state row 0 stands in.
    sid = batch.state_ids if states is not None else torch.zeros_like(batch.start)
    freq = dummy if params.inv_freq is None else params.inv_freq.contiguous()
    p = 0 if params.inv_freq is None else params.inv_freq.numel()
    cp = triton.next_power_of_2(c)
    # The rotation's workspace: a row per program.
    ws = torch.empty(_compress_tuned.grid(n)[0] * cp, device=kv.device) if p else dummy
    _compress_tuned[lambda meta: _compress_tuned.grid(n)](
        kv,
        gate,
        ape,
        bkv,
        bgate,
        okv,
        ogate,
        params.norm_weight.contiguous(),
        freq,
        batch.request,
        batch.order,
        batch.cu_seqlens,
        batch.start,
        sid,
        batch.slots,
        out,
        dummy if out_scale is None else out_scale,
        ws,
        n,
        c,
        width,
        kv.stride(0),
        r,
        p,
        params.eps,
        OVERLAP=params.overlap,
        HAS_GATE=r > 1,
        HAS_APE=params.ape is not None,
        ROPE=p > 0,
        QUANT=out.dtype == torch.int8,
        CP=cp,
    )
    if states is None or r == 1:
        return
    _state_tuned[lambda meta: _state_tuned.grid(reqs * triton.cdiv(width, meta["BLOCK_C"]))](
        kv,
        gate,
        ape,
        bkv,
        bgate,
        okv,
        ogate,
        batch.cu_seqlens,
        batch.start,
        sid,
        reqs,
        c,
        width,
        kv.stride(0),
        r,
        OVERLAP=params.overlap,
        HAS_APE=params.ape is not None,
    )


# Footprints at c = 512 with overlap (W = 1024): about nine [BLOCK_S, CP] tiles live in the slot loop
# (offsets, masks, kv and gate as loaded and summed, the exponentials and their product with kv) and a
# dozen [CP] rows (running max, sum and accumulator, weight, the normed row and its rotation).
_CP = 512


def _compress_ub(block_s: int) -> int:
    return 4 * (9 * block_s * _CP + 12 * _CP)


# The state kernel moves [BLOCK_S, BLOCK_C] tiles: the new and buffered rows' offsets and masks, kv and
# gate as loaded and summed, ape and the store offsets.
def _state_ub(block_s: int, block_c: int) -> int:
    return 4 * 10 * block_s * block_c


_COMPRESS_CONFIGS = (
    TuneConfig({"BLOCK_S": 4}, _compress_ub(4)),
    TuneConfig({"BLOCK_S": 8}, _compress_ub(8), multibuffer=False),
)
_STATE_CONFIGS = tuple(
    TuneConfig({"BLOCK_S": bs, "BLOCK_C": bc}, _state_ub(bs, bc)) for bs, bc in ((4, 512), (16, 128))
)


def _compress_signature(x: str, out: str) -> dict[str, str]:
    return {
        **dict.fromkeys(("kv_ptr", "gate_ptr"), x),
        **dict.fromkeys(
            ("ape_ptr", "bkv_ptr", "bgate_ptr", "okv_ptr", "ogate_ptr", "norm_ptr", "freq_ptr"), "*fp32"
        ),
        **dict.fromkeys(("req_ptr", "order_ptr", "cu_ptr", "start_ptr", "sid_ptr", "slot_ptr"), "*i32"),
        "out_ptr": out,
        **dict.fromkeys(("oscale_ptr", "ws_ptr"), "*fp32"),
        **dict.fromkeys(("N", "C", "W", "SX", "R", "P"), "i32"),
        "eps": "fp32",
    }


def _state_signature(x: str) -> dict[str, str]:
    return {
        **dict.fromkeys(("kv_ptr", "gate_ptr"), x),
        **dict.fromkeys(("ape_ptr", "bkv_ptr", "bgate_ptr", "okv_ptr", "ogate_ptr"), "*fp32"),
        **dict.fromkeys(("cu_ptr", "start_ptr", "sid_ptr"), "*i32"),
        **dict.fromkeys(("n_req", "C", "W", "SX", "R"), "i32"),
    }


# The model's compressors: V4 CSA (overlap, also the indexer's at c = 128) and HCA, V4.1 ratio 2 and 1.
_VARIANTS = (
    {"OVERLAP": 1, "HAS_GATE": 1, "HAS_APE": 1, "ROPE": 1, "CP": 512},
    {"OVERLAP": 1, "HAS_GATE": 1, "HAS_APE": 1, "ROPE": 1, "CP": 128},
    {"OVERLAP": 0, "HAS_GATE": 1, "HAS_APE": 1, "ROPE": 1, "CP": 512},
    {"OVERLAP": 0, "HAS_GATE": 1, "HAS_APE": 0, "ROPE": 0, "CP": 512},
    {"OVERLAP": 0, "HAS_GATE": 0, "HAS_APE": 0, "ROPE": 0, "CP": 512},
)

_compress_tuned = tuning.TunedKernel(
    _compress_kernel,
    _COMPRESS_CONFIGS,
    key=["C", "W", "R"],
    variants=tuple(
        Variant({**variant, "QUANT": quant}, tuple(_compress_signature(x, out) for x, out in pairs))
        for variant in _VARIANTS
        for quant, pairs in (
            (0, (("*fp32", "*fp32"), ("*bf16", "*bf16"))),
            (1, (("*fp32", "*i8"), ("*bf16", "*i8"))),
        )
    ),
)
_state_tuned = tuning.TunedKernel(
    _compress_state_kernel,
    _STATE_CONFIGS,
    key=["W", "R"],
    variants=tuple(
        Variant({"OVERLAP": overlap, "HAS_APE": ape}, (_state_signature("*fp32"), _state_signature("*bf16")))
        for overlap, ape in ((1, 1), (0, 1), (0, 0))
    ),
)
KERNELS = (_compress_tuned, _state_tuned)
