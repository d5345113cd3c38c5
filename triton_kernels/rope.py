"""Partial, interleaved rotary position embedding (DeepSeek V4 RoPE, model-spec §4.2).

Contract
    ``rope_inv_freq(rope_dim, theta, yarn) -> [rope_dim // 2]`` fp32: ``theta ** (-2i / rope_dim)``,
    with YaRN frequency interpolation when ``yarn`` is given (no magnitude factor: V4 leaves cos/sin
    unscaled).

    ``apply_rope(x [T, D] | [T, H, D], positions [T] int32/int64, inv_freq [P] fp32, inverse) -> like x``:
    only the last ``2P`` channels rotate; pair ``(2i, 2i+1)`` of that slice is turned by
    ``positions[t] * inv_freq[i]`` (fp32, as transformers computes it), or by minus that angle with
    ``inverse=True`` (the attention output). The leading NoPE channels are copied unchanged. With
    ``norm_eps``, ``x`` is first RMS-normalised over its last dim, weighted by ``norm_weight`` when given
    (``rmsnorm``'s contract: fp32, rounded once to the dtype of ``x``), as the keys and V4's queries are.
    With ``cache`` (a pool ``[num_slots, D]`` of x's dtype) and ``slots [T]``, the rows of a 2-D ``x``
    are also stored into the cache as they are returned (``kv_store.store_rows``'s contract: ``-1`` not
    written): the window keys, rotated and stored in one launch.
    Positions are not range-checked (that would synchronise the device); the fp32 angle follows
    transformers exactly for positions below 2**24. cos/sin stay fp32 for bf16 input too, where
    transformers rounds them to bf16 first. The reference computes the cos/sin of a (positions,
    inv_freq) pair once and reuses them while both tensors live unchanged (one step's layers share them).

Kernel
    One task is ``BLOCK_R`` (token, head) rows: the NoPE part is copied in ``BLOCK_D`` sub-tiles, the
    rope part is read as one contiguous tile, split into its even and odd channels on chip and rotated
    in fp32 (no strided loads: Ascend moves contiguous rows only at full speed). A norm first sweeps the
    NoPE sub-tiles for the sum of squares, then scales each sub-tile as it is copied.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakTensorKeyDictionary

from triton_kernels import runtime, tuning
from triton_kernels.kv_store import store_rows_ref, validate_store
from triton_kernels.rmsnorm import rms_norm_ref, validate_norm
from triton_kernels.shared import rms_factor, rotate_pairs
from triton_kernels.spec import TuneConfig, Variant

_DTYPES = (torch.float32, torch.bfloat16)
_POS_DTYPES = (torch.int32, torch.int64)
_MAX_NUMEL = 2**31 - 1  # offsets are int32 inside the kernel


class YarnScaling(Protocol):
    """What ``rope_inv_freq`` reads of a YaRN ``rope_scaling`` (the config's ``Yarn``)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float


def rope_inv_freq(rope_dim: int, theta: float, yarn: YarnScaling | None = None) -> torch.Tensor:
    if rope_dim < 2 or rope_dim % 2:
        raise ValueError(f"rope_dim: {rope_dim} must be even and >= 2")
    if not theta > 1:
        raise ValueError(f"theta: {theta} must be > 1")
    inv_freq = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    if yarn is None:
        return inv_freq

    def correction_dim(beta: float) -> float:
        # The pair index whose wavelength fits `beta` times into the original context.
        return (
            rope_dim
            * math.log(yarn.original_max_position_embeddings / (2 * math.pi * beta))
            / (2 * math.log(theta))
        )

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), rope_dim - 1)
    if high == low:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    # Pairs below `low` keep their frequency, pairs above `high` are slowed down by `factor`.
    return inv_freq / yarn.factor * ramp + inv_freq * (1 - ramp)


def apply_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    inverse: bool = False,
    norm_eps: float | None = None,
    norm_weight: torch.Tensor | None = None,
    cache: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    _validate(x, positions, inv_freq)
    if norm_eps is not None:
        validate_norm(x, norm_weight, norm_eps)
    elif norm_weight is not None:
        raise ValueError("norm_weight: given without norm_eps")
    if (cache is None) != (slots is None):
        raise ValueError("cache / slots: give both or neither")
    if cache is not None:
        if x.dim() != 2 or cache.dtype != x.dtype:
            raise ValueError(
                f"x: {x.dtype} {tuple(x.shape)} must be [T, D] of the cache's {cache.dtype} to be stored"
            )
        validate_store(x, slots, cache)
    run = apply_rope_triton if runtime.use_triton(x) else apply_rope_ref
    return run(x, positions, inv_freq, inverse, norm_eps, norm_weight, cache, slots)


def _validate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> None:
    if x.dtype not in _DTYPES:
        raise ValueError(f"x: dtype {x.dtype} not supported, expected one of {_DTYPES}")
    if x.dim() not in (2, 3):
        raise ValueError(f"x: shape {tuple(x.shape)} must be [T, D] or [T, H, D]")
    if x.numel() > _MAX_NUMEL:
        raise ValueError(f"x: {x.numel()} elements exceeds the limit {_MAX_NUMEL}")
    if inv_freq.dtype != torch.float32 or inv_freq.dim() != 1 or inv_freq.numel() < 1:
        raise ValueError(
            f"inv_freq: {inv_freq.dtype} {tuple(inv_freq.shape)} must be a non-empty 1-D float32 tensor"
        )
    if 2 * inv_freq.numel() > x.shape[-1]:
        raise ValueError(f"inv_freq: {inv_freq.numel()} pairs do not fit the last dim {x.shape[-1]} of x")
    if positions.dtype not in _POS_DTYPES:
        raise ValueError(f"positions: dtype {positions.dtype} not supported, expected one of {_POS_DTYPES}")
    if positions.shape != x.shape[:1]:
        raise ValueError(
            f"positions: shape {tuple(positions.shape)} must be ({x.shape[0]},), one per token of x"
        )
    for name, t in (("positions", positions), ("inv_freq", inv_freq)):
        if t.device != x.device:
            raise ValueError(f"{name}: device {t.device} differs from x's device {x.device}")


def apply_rope_ref(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    inverse: bool = False,
    norm_eps: float | None = None,
    norm_weight: torch.Tensor | None = None,
    cache: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    out = _rotated_ref(x, positions, inv_freq, inverse, norm_eps, norm_weight)
    if cache is not None:
        store_rows_ref(out, slots, cache)
    return out


def _rotated_ref(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    inverse: bool,
    norm_eps: float | None,
    norm_weight: torch.Tensor | None,
) -> torch.Tensor:
    if norm_eps is not None:
        x = rms_norm_ref(x, norm_weight, norm_eps)
    cos, sin = _angles(positions, inv_freq)
    if x.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    nope = x.shape[-1] - cos.shape[-1]
    rope = x[..., nope:].float()
    # Pair (even, odd) -> (even·cos - odd·sin, odd·cos + even·sin), with sin signed per channel.
    swapped = rope.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    rotated = rope * cos - swapped * sin if inverse else rope * cos + swapped * sin
    return torch.cat((x[..., :nope], rotated.to(x.dtype)), dim=-1)


# positions -> id(inv_freq) -> (inv_freq, both versions, cos, sin); an entry lives as long as its positions.
_ANGLES: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def _angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos [T, 2P]`` repeated per pair and ``sin [T, 2P]`` negated on the even channels.

    A step rotates queries, keys and the attention output of every layer at the same positions tensor:
    its angles are computed once per table and reused while neither tensor changes. A trace keeps its
    own (its graph computes them from the positions of each replay, once).
    """
    by_positions = runtime.per_trace(_ANGLES)
    if by_positions is None:
        return _cos_sin(positions, inv_freq)
    tables = by_positions.setdefault(positions, {})
    versions = (positions._version, inv_freq._version)
    hit = tables.get(id(inv_freq))  # the entry holds inv_freq, so its id is not reused meanwhile
    if hit is not None and hit[1] == versions:
        return hit[2], hit[3]
    cos, sin = _cos_sin(positions, inv_freq)
    tables[id(inv_freq)] = (inv_freq, versions, cos, sin)
    return cos, sin


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angle = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angle.cos(), angle.sin()
    return torch.stack((cos, cos), dim=-1).flatten(-2), torch.stack((-sin, sin), dim=-1).flatten(-2)


@triton.jit(do_not_specialize=["R"])
def _rope_kernel(
    x_ptr,
    pos_ptr,
    freq_ptr,
    w_ptr,
    out_ptr,
    cache_ptr,
    slot_ptr,
    R,
    H,
    D,
    P,
    stride_x,
    stride_out,
    stride_cache,
    sign,
    eps,
    NORM: tl.constexpr,
    WEIGHTED: tl.constexpr,
    STORE: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    nope = D - 2 * P
    pair = tl.arange(0, HALF)
    pair_ok = pair < P
    freq = tl.load(freq_ptr + pair, mask=pair_ok, other=0.0)
    for task in range(pid, tl.cdiv(R, BLOCK_R), tl.num_programs(0)):
        rows = task * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < R
        src = x_ptr + rows[:, None] * stride_x
        dst = out_ptr + rows[:, None] * stride_out
        if STORE:  # one row a token (H = 1); slot -1 is not written
            slot = tl.load(slot_ptr + rows, mask=row_ok, other=-1)
            stored = slot.to(tl.float32) >= 0  # the sign, exact in fp32
            line = cache_ptr + tl.where(stored, slot, 0)[:, None] * stride_cache
        # The rope channels as one contiguous [rows, 2 * HALF] tile, split into its pairs on chip.
        rope_cols = nope + tl.arange(0, 2 * HALF)
        rope_mask = row_ok[:, None] & (rope_cols[None, :] < D)
        x = tl.load(src + rope_cols[None, :], mask=rope_mask, other=0.0).to(tl.float32)
        if NORM:
            sum_sq = tl.sum(x * x, axis=1)
            for d0 in range(0, nope, BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)
                xv = tl.load(src + cols[None, :], mask=row_ok[:, None] & (cols[None, :] < nope), other=0.0)
                sum_sq += tl.sum(xv.to(tl.float32) * xv.to(tl.float32), axis=1)
            rstd = rms_factor(sum_sq, D, eps)
            x = x * rstd[:, None]
            if WEIGHTED:
                x = x * tl.load(w_ptr + rope_cols, mask=rope_cols < D, other=0.0)[None, :]
            x = x.to(out_ptr.dtype.element_ty).to(tl.float32)  # the norm's output, as the model rounds it
        for d0 in range(0, nope, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            mask = row_ok[:, None] & (cols[None, :] < nope)
            xv = tl.load(src + cols[None, :], mask=mask)
            if NORM:
                xv = xv.to(tl.float32) * rstd[:, None]
                if WEIGHTED:
                    xv = xv * tl.load(w_ptr + cols, mask=cols < nope, other=0.0)[None, :]
            tl.store(dst + cols[None, :], xv.to(out_ptr.dtype.element_ty), mask=mask)
            if STORE:
                at, kept = line + tl.minimum(cols, nope - 1)[None, :], mask & stored[:, None]
                tl.store(at, xv.to(out_ptr.dtype.element_ty), mask=kept)  # in-bounds: slot and column clamped
        pos = tl.load(pos_ptr + rows // H, mask=row_ok, other=0).to(tl.float32)
        angle = pos[:, None] * freq[None, :]
        cos = tl.cos(angle)
        sin = tl.sin(angle) * sign
        cols = rope_cols
        mask = rope_mask
        y = rotate_pairs(x, cos, sin)
        tl.store(dst + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)
        if STORE:
            at, kept = line + tl.minimum(cols, D - 1)[None, :], mask & stored[:, None]
            tl.store(at, y.to(out_ptr.dtype.element_ty), mask=kept)  # in-bounds: slot and column clamped


def apply_rope_triton(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    inverse: bool = False,
    norm_eps: float | None = None,
    norm_weight: torch.Tensor | None = None,
    cache: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    heads, d, p = (x.shape[1] if x.dim() == 3 else 1), x.shape[-1], inv_freq.numel()
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    if rows > 0:
        _rope_tuned[lambda meta: _rope_tuned.grid(triton.cdiv(rows, meta["BLOCK_R"]))](
            x2,
            positions.contiguous(),
            inv_freq.contiguous(),
            x2 if norm_weight is None else norm_weight,  # read only when weighted
            out,
            out if cache is None else cache,  # written only with a cache
            positions if slots is None else slots.contiguous(),
            rows,
            heads,
            d,
            p,
            x2.stride(0),
            d,
            0 if cache is None else cache.stride(0),
            -1.0 if inverse else 1.0,
            1.0 if norm_eps is None else norm_eps,
            NORM=norm_eps is not None,
            WEIGHTED=norm_weight is not None,
            STORE=cache is not None,
            HALF=triton.next_power_of_2(p),
        )
    return out.view(x.shape)


def rotate_rope_channels_triton(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False
) -> None:
    """``apply_rope`` in place on a contiguous ``x [T, H, D]``, reading and writing only its last ``2P``
    channels (the attention output's de-rotation: the NoPE channels are not touched)."""
    t, heads, d = x.shape
    p = inv_freq.numel()
    rows = t * heads
    if rows == 0 or p == 0:
        return
    rope = x.view(rows, d)[:, d - 2 * p :]
    _rope_tuned[lambda meta: _rope_tuned.grid(triton.cdiv(rows, meta["BLOCK_R"]))](
        rope,
        positions.contiguous(),
        inv_freq.contiguous(),
        rope,  # never read: no norm
        rope,
        rope,  # never written: no cache
        positions,
        rows,
        heads,
        2 * p,
        p,
        d,
        d,
        0,
        -1.0 if inverse else 1.0,
        1.0,
        NORM=False,
        WEIGHTED=False,
        STORE=False,
        HALF=triton.next_power_of_2(p),
    )


_HALF = 32  # rope_dim 64 in every release


def _ub_bytes(block_r: int, block_d: int) -> int:
    # The copied NoPE tile with its fp32 copy, the squares and the weight tile, then angle, cos, sin, two
    # inputs and two outputs per rope pair, and per row its position, sum of squares and factor, and its
    # slot with its mask and cache row (a stored rotation).
    return 4 * (3 * block_r * block_d + block_d + 7 * block_r * _HALF + 3 * _HALF + 8 * block_r)


_CONFIGS = tuple(
    TuneConfig({"BLOCK_R": br, "BLOCK_D": bd}, _ub_bytes(br, bd))
    for br, bd in ((4, 512), (8, 256), (16, 128))
)


def _signature(x: str, pos: str, w: str, cache: str | None = None, slot: str | None = None) -> dict[str, str]:
    ints = dict.fromkeys(("R", "H", "D", "P", "stride_x", "stride_out", "stride_cache"), "i32")
    pointers = {"x_ptr": x, "pos_ptr": pos, "freq_ptr": "*fp32", "w_ptr": w, "out_ptr": x}
    stored = {"cache_ptr": cache or x, "slot_ptr": slot or pos}
    return {**pointers, **stored, **ints, "sign": "fp32", "eps": "fp32"}


_rope_tuned = tuning.TunedKernel(
    _rope_kernel,
    _CONFIGS,
    key=["D", "HALF"],
    # Plain (queries of V4.1 and the indexers, the output's de-rotation: positions of either dtype), after
    # V4's unweighted head norm, after the keys' weighted norm (the step's positions), and the window keys
    # stored as they are rotated (into a cache of their dtype, at the step's int32 slots).
    variants=(
        Variant(
            {"NORM": 0, "WEIGHTED": 0, "STORE": 0, "HALF": _HALF},
            tuple(_signature(x, pos, x) for x in ("*fp32", "*bf16") for pos in ("*i64", "*i32")),
        ),
        *(
            Variant(
                {"NORM": 1, "WEIGHTED": weighted, "STORE": 0, "HALF": _HALF},
                tuple(_signature(x, "*i64", "*fp32" if weighted else x) for x in ("*fp32", "*bf16")),
            )
            for weighted in (0, 1)
        ),
        Variant(
            {"NORM": 1, "WEIGHTED": 1, "STORE": 1, "HALF": _HALF},
            tuple(_signature(x, "*i64", "*fp32", x, "*i32") for x in ("*fp32", "*bf16")),
        ),
    ),
    never_one=("D",),  # 2P <= D with P >= 1; the adapter crashes on D = P = 1
)
KERNELS = (_rope_tuned,)
