"""Manifold-constrained hyper-connections (mHC, model-spec §5): coefficients, collapse and update.

The residual is ``n`` streams per token, ``x [T, n, D]`` (fp32 or bf16); a sublayer has
``fn [m, n*D]``, ``base [m]``, ``scale [3]`` in fp32, ``m = (2 + n) * n``.

Contract
    ``hc_coeffs(x, fn, base, scale, *, norm_eps, hc_eps, sinkhorn_iters) -> (pre [T, n], post [T, n],
    comb [T, n, n])``, all fp32: ``x̂ = x.flatten(1) * rsqrt(mean(x**2) + norm_eps)``, ``mu = fn @ x̂``,
    ``pre = sigmoid(mu[:n] * scale[0] + base[:n]) + hc_eps``, ``post = 2 * sigmoid(mu[n:2n] * scale[1]
    + base[n:2n])``, ``comb = softmax_j(mu[2n:] * scale[2] + base[2n:]).view(n, n) + hc_eps``, then a
    column normalisation and ``sinkhorn_iters - 1`` (row, column) normalisations, each dividing by
    ``sum + hc_eps``.

    ``hc_mix(x, fn, base, scale, *, norm_eps, hc_eps, sinkhorn_iters, input_weight, input_eps, carry=None)
    -> (pre, post, comb, h [T, D])``: ``hc_coeffs`` and the sublayer's input in one op, ``h =
    hc_collapse(x, carry if given else pre, input_weight, input_eps)`` (V4.1 collapses by the pre-mix it
    carries, V4 by the sublayer's own).

    ``hc_head_coeffs(x, fn [n, n*D], base [n], scale [1], *, norm_eps, hc_eps) -> pre [T, n]`` fp32:
    the final collapse weights of V4 (``sigmoid(mu * scale + base) + hc_eps``, no Sinkhorn).

    ``hc_collapse(x, pre, norm_weight=None, norm_eps=None) -> [T, D]``: ``sum_k pre[k] * x[k]`` in fp32,
    cast to the dtype of ``x``; with ``norm_eps``, then ``rmsnorm.rms_norm(·, norm_weight, norm_eps)``
    (the sublayer's input norm, its contract; ``norm_weight`` [D] fp32 or None), in one op.

    ``hc_update(x, f [T, D], post, comb) -> [T, n, D]``: ``out[j] = post[j] * f + sum_i comb[i, j] * x[i]``
    (comb used transposed), in fp32 with one cast to the dtype of ``x``; transformers' decoder layer
    rounds ``post``/``comb`` to bf16 and mixes in bf16 for bf16 streams.

Kernels
    ``_hc_mix_kernel``: one task is ``BLOCK_T`` tokens. One sweep over ``n*D`` in ``BLOCK_K`` chunks
    accumulates the sum of squares and ``x @ fn.T`` on the cube unit (``fn`` is read once per token
    block, not once per token); the norm is applied to the [BLOCK_T, m] product (the official
    kernel's order; transformers normalises first, equal up to rounding). Activations and Sinkhorn
    follow on a [BLOCK_T, NP, R_PAD] tile of mix slots (slot ``(j, r)``): rows ``r < n`` hold ``comb``,
    row ``NP`` ``pre``, row ``NP + 1`` ``post``. ``HEAD`` selects the ``hc_head`` variant (pre only).
    ``COLLAPSE`` (``hc_mix``) then collapses the task's tokens by ``pre`` (or ``carry``, ``CARRIED``) in
    ``[BLOCK_T, BLOCK_K]`` column tiles, swept twice for the norm as the collapse kernel sweeps a row.
    ``_hc_collapse_kernel`` / ``_hc_update_kernel``: one task is a (token, ``BLOCK_D`` columns) tile; with
    the norm a collapse task is a token, whose row is collapsed twice in ``BLOCK_D`` sub-tiles (the sum
    of squares of the rounded row, then the same row normalised and stored), as ``rmsnorm`` sweeps.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from triton_kernels import runtime, tuning
from triton_kernels.rmsnorm import rms_norm_ref, validate_norm
from triton_kernels.shared import gather_rows, rms_factor
from triton_kernels.spec import TuneConfig, Variant

_DTYPES = (torch.float32, torch.bfloat16)
_MAX_STREAMS = 16
_MAX_NUMEL = 2**31 - 1  # offsets are int32 inside the kernels
_COLLAPSE_COLS = tl.constexpr(32)  # hc_mix's collapse tiles: [BLOCK_T, 32]


def hc_coeffs(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_coeffs(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)
    run = hc_coeffs_triton if runtime.use_triton(x) else hc_coeffs_ref
    return run(x, fn, base, scale, norm_eps=norm_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters)


def hc_mix(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    input_weight: torch.Tensor | None,
    input_eps: float,
    carry: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    t, n, _ = _check_coeffs(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)
    if carry is not None:
        _check_param("carry", carry, (t, n), x)
    validate_norm(x[:, 0], input_weight, input_eps)
    run = hc_mix_triton if runtime.use_triton(x) else hc_mix_ref
    coeffs = {"norm_eps": norm_eps, "hc_eps": hc_eps, "sinkhorn_iters": sinkhorn_iters}
    return run(x, fn, base, scale, **coeffs, input_weight=input_weight, input_eps=input_eps, carry=carry)


def _check_coeffs(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[int, int, int]:
    t, n, d = _check_streams(x)
    m = (2 + n) * n
    _check_param("fn", fn, (m, n * d), x)
    _check_param("base", base, (m,), x)
    _check_param("scale", scale, (3,), x)
    _check_eps(norm_eps, hc_eps)
    if sinkhorn_iters < 1:
        raise ValueError(f"sinkhorn_iters: {sinkhorn_iters} must be >= 1")
    return t, n, d


def hc_head_coeffs(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
) -> torch.Tensor:
    _, n, d = _check_streams(x)
    _check_param("fn", fn, (n, n * d), x)
    _check_param("base", base, (n,), x)
    _check_param("scale", scale, (1,), x)
    _check_eps(norm_eps, hc_eps)
    run = hc_head_coeffs_triton if runtime.use_triton(x) else hc_head_coeffs_ref
    return run(x, fn, base, scale, norm_eps=norm_eps, hc_eps=hc_eps)


def hc_collapse(
    x: torch.Tensor, pre: torch.Tensor, norm_weight: torch.Tensor | None = None, norm_eps: float | None = None
) -> torch.Tensor:
    t, n, _ = _check_streams(x)
    _check_param("pre", pre, (t, n), x)
    if norm_eps is not None:
        validate_norm(x[:, 0], norm_weight, norm_eps)
    elif norm_weight is not None:
        raise ValueError("norm_weight: given without norm_eps")
    run = hc_collapse_triton if runtime.use_triton(x) else hc_collapse_ref
    return run(x, pre, norm_weight, norm_eps)


def hc_update(x: torch.Tensor, f: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    t, n, d = _check_streams(x)
    if f.shape != (t, d) or f.dtype != x.dtype or f.device != x.device:
        raise ValueError(
            f"f: {f.dtype} {tuple(f.shape)} on {f.device} must be {x.dtype} {(t, d)} on {x.device}, like x"
        )
    _check_param("post", post, (t, n), x)
    _check_param("comb", comb, (t, n, n), x)
    return hc_update_triton(x, f, post, comb) if runtime.use_triton(x) else hc_update_ref(x, f, post, comb)


def _check_streams(x: torch.Tensor) -> tuple[int, int, int]:
    if x.dtype not in _DTYPES:
        raise ValueError(f"x: dtype {x.dtype} not supported, expected one of {_DTYPES}")
    if x.dim() != 3 or x.shape[1] < 1 or x.shape[2] < 1:
        raise ValueError(f"x: shape {tuple(x.shape)} must be [T, n, D] with n, D >= 1")
    if x.shape[1] > _MAX_STREAMS:
        raise ValueError(f"x: {x.shape[1]} streams exceeds the limit {_MAX_STREAMS}")
    if x.numel() > _MAX_NUMEL:
        raise ValueError(f"x: {x.numel()} elements exceeds the limit {_MAX_NUMEL}")
    return x.shape[0], x.shape[1], x.shape[2]


def _check_param(name: str, p: torch.Tensor, shape: tuple[int, ...], x: torch.Tensor) -> None:
    if p.dtype != torch.float32 or p.shape != shape or p.device != x.device:
        raise ValueError(
            f"{name}: {p.dtype} {tuple(p.shape)} on {p.device} must be torch.float32 {shape} on {x.device}"
        )


def _check_eps(norm_eps: float, hc_eps: float) -> None:
    if not norm_eps > 0:
        raise ValueError(f"norm_eps: {norm_eps} must be > 0")
    if not hc_eps >= 0:
        raise ValueError(f"hc_eps: {hc_eps} must be >= 0")


def _normed_mix(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    return rms_norm_ref(x.flatten(1).float(), None, norm_eps) @ fn.T


def hc_coeffs_ref(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = x.shape[1]
    # Each coefficient's scale spread over its columns: one product and one sum for all three (elementwise,
    # so the values of three sliced ones). The gates' inputs are copied out contiguous, as transformers
    # computes them: the CPU's sigmoid may round a value in a strided row differently.
    logits = _normed_mix(x, fn, norm_eps) * scale[_scale_columns(n, scale.device)] + base
    pre = torch.sigmoid(logits[:, :n].contiguous()) + hc_eps
    post = 2 * torch.sigmoid(logits[:, n : 2 * n].contiguous())
    comb = torch.softmax(logits[:, 2 * n :].view(-1, n, n), dim=-1).add_(hc_eps).permute(1, 2, 0).contiguous()
    _sinkhorn_(comb, hc_eps, sinkhorn_iters)
    return pre, post, comb.permute(2, 0, 1).contiguous()


@functools.cache
def _scale_columns(n: int, device: torch.device) -> torch.Tensor:
    """Which of the three scales each of the ``(2 + n) * n`` mixed columns takes."""
    return torch.tensor([0] * n + [1] * n + [2] * n * n, device=device)


def _sinkhorn_(comb: torch.Tensor, hc_eps: float, iters: int) -> None:
    """The column normalisation and ``iters - 1`` (row, column) ones of ``comb [n, n, T]``, in place.

    Tokens last: both sums run over an outer axis, adding whole rows of tokens one after another (the order
    of a sum over 4 contiguous values too, so the result is the same bit for bit). The iterations are
    many tiny ops: on the CPU, numpy's calls cost a fraction of torch's dispatch, and no call allocates
    (a trace records torch's).
    """
    n, _, t = comb.shape
    cols, rows = comb.new_empty(1, n, t), comb.new_empty(n, 1, t)  # sums over axis 0, over axis 1
    if comb.device.type != "cpu" or runtime.tracing():
        eps = comb.new_full((), hc_eps)  # a tensor of comb's dtype: added as the number is, with no cast
        for axis, total in [(0, cols)] + [(1, rows), (0, cols)] * (iters - 1):
            comb.div_(torch.sum(comb, axis, keepdim=True, out=total).add_(eps))
        return
    a, cols_np, rows_np = comb.detach().numpy(), cols.numpy(), rows.numpy()
    for axis, total in [(0, cols_np)] + [(1, rows_np), (0, cols_np)] * (iters - 1):
        np.add.reduce(a, axis=axis, keepdims=True, out=total)
        total += hc_eps
        np.divide(a, total, out=a)


def hc_head_coeffs_ref(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
) -> torch.Tensor:
    return torch.sigmoid(_normed_mix(x, fn, norm_eps) * scale + base) + hc_eps


def hc_mix_ref(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    input_weight: torch.Tensor | None,
    input_eps: float,
    carry: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    pre, post, comb = hc_coeffs_ref(
        x, fn, base, scale, norm_eps=norm_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters
    )
    h = hc_collapse_ref(x, pre if carry is None else carry, input_weight, input_eps)
    return pre, post, comb, h


def hc_collapse_ref(
    x: torch.Tensor, pre: torch.Tensor, norm_weight: torch.Tensor | None = None, norm_eps: float | None = None
) -> torch.Tensor:
    out = (pre[:, :, None] * x.float()).sum(1).to(x.dtype)
    return out if norm_eps is None else rms_norm_ref(out, norm_weight, norm_eps)


def hc_update_ref(x: torch.Tensor, f: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``post_j f + sum_i comb_ij x_i`` per token: the mix, plus the outer product ``post f`` added by one
    batched GEMM of inner size 1 (each product exact, one addition: as ``post * f + mixed``)."""
    mixed = torch.bmm(comb.transpose(1, 2), x.float())
    return torch.baddbmm(mixed, post[:, :, None], f[:, None, :].float()).to(x.dtype)


@triton.jit(do_not_specialize=["T"])
def _hc_mix_kernel(
    x_ptr,
    fn_ptr,
    base_ptr,
    scale_ptr,
    pre_ptr,
    post_ptr,
    comb_ptr,
    carry_ptr,
    w_ptr,
    h_ptr,
    T,
    n,
    K,
    norm_eps,
    hc_eps,
    iters,
    input_eps,
    HEAD: tl.constexpr,
    COLLAPSE: tl.constexpr,
    CARRIED: tl.constexpr,
    WEIGHTED: tl.constexpr,
    NP: tl.constexpr,
    R_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    # Slot (j, r) at j * R_PAD + r: the working tile is [BLOCK_T, NP, R_PAD]. Laid out [BLOCK_T, R_PAD, NP]
    # (NP last: 4 fp32 at the model's n = 4) it made BiSheng's memory planning abort.
    slot = tl.arange(0, NP * R_PAD)
    j, r = slot // R_PAD, slot % R_PAD
    # fn rows: pre j -> j, post j -> n + j, comb (r, j) -> 2n + r*n + j (the hc_head fn has pre rows only).
    fn_row = tl.where(r == NP, j, tl.where(r == NP + 1, n + j, 2 * n + r * n + j))
    s_pre = tl.load(scale_ptr)
    if HEAD:
        used = (r == NP) & (j < n)
        scale = tl.where(r == NP, s_pre, 0.0)
    else:
        used = ((r == NP) | (r == NP + 1) | (r < n)) & (j < n)
        scale = tl.where(
            r == NP, s_pre, tl.where(r == NP + 1, tl.load(scale_ptr + 1), tl.load(scale_ptr + 2))
        )
    fn_row = tl.where(used, fn_row, 0)  # unused slots read row 0 (Ascend drops these gathers' masks)
    base = tl.load(base_ptr + fn_row, mask=used, other=0.0)  # in-bounds: unused slots read row 0
    j3 = tl.arange(0, NP)[None, :, None]
    r3 = tl.arange(0, R_PAD)[None, None, :]
    jj = tl.arange(0, NP)
    for task in range(pid, tl.cdiv(T, BLOCK_T), tl.num_programs(0)):
        tok = task * BLOCK_T + tl.arange(0, BLOCK_T)
        tok_ok = tok < T
        acc = tl.zeros([BLOCK_T, NP * R_PAD], dtype=tl.float32)
        sq = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < K
            xv = tl.load(
                x_ptr + tok[:, None] * K + kk[None, :], mask=tok_ok[:, None] & k_ok[None, :], other=0.0
            )
            xv = xv.to(tl.float32)
            w = gather_rows(fn_ptr, fn_row, used, kk, K, K, k0 + BLOCK_K <= K)
            sq += xv * xv
            # ieee: the tf32 default on GPUs would cost ~1e-3 relative error in the mixes.
            acc = tl.dot(xv, tl.trans(w), acc, input_precision="ieee")
        rstd = rms_factor(tl.sum(sq, axis=1), K, norm_eps)
        z = tl.reshape(acc * rstd[:, None] * scale[None, :] + base[None, :], [BLOCK_T, NP, R_PAD])
        gate = 1.0 / (1.0 + tl.exp(-z))
        out_ok = tok_ok[:, None] & (jj[None, :] < n)
        pre = tl.sum(tl.where(r3 == NP, gate, 0.0), axis=2) + hc_eps
        tl.store(pre_ptr + tok[:, None] * n + jj[None, :], pre, mask=out_ok)
        if not HEAD:
            post = 2.0 * tl.sum(tl.where(r3 == NP + 1, gate, 0.0), axis=2)
            tl.store(post_ptr + tok[:, None] * n + jj[None, :], post, mask=out_ok)
            logits = tl.where(j3 < n, z, float("-inf"))
            # Rows of comb (its softmax) run along axis 1 (j), columns along axis 2 (r).
            e = tl.exp(logits - tl.max(logits, axis=1)[:, None, :])
            comb = tl.where((r3 < n) & (j3 < n), e / tl.sum(e, axis=1)[:, None, :] + hc_eps, 0.0)
            comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
            for _ in range(iters - 1):
                comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
                comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
            tok3 = tok[:, None, None]
            tl.store(comb_ptr + tok3 * n * n + r3 * n + j3, comb, mask=(tok3 < T) & (r3 < n) & (j3 < n))
        if COLLAPSE:
            if CARRIED:
                pre = tl.load(carry_ptr + tok[:, None] * n + jj[None, :], mask=out_ok, other=0.0)
            D = K // n
            # Column tiles of their own: at BLOCK_K = 64 the sweeps would overflow the unified buffer.
            sq = tl.zeros([BLOCK_T, _COLLAPSE_COLS], dtype=tl.float32)
            for c0 in range(0, D, _COLLAPSE_COLS):
                y = _collapsed_tile(x_ptr, pre, tok, tok_ok, n, D, c0 + tl.arange(0, _COLLAPSE_COLS), NP)
                sq += y * y
            rstd = rms_factor(tl.sum(sq, axis=1), D, input_eps)
            for c0 in range(0, D, _COLLAPSE_COLS):
                cols = c0 + tl.arange(0, _COLLAPSE_COLS)
                y = _collapsed_tile(x_ptr, pre, tok, tok_ok, n, D, cols, NP) * rstd[:, None]
                if WEIGHTED:
                    y = y * tl.load(w_ptr + cols, mask=cols < D, other=0.0)[None, :]
                mask = tok_ok[:, None] & (cols[None, :] < D)
                tl.store(h_ptr + tok[:, None] * D + cols[None, :], y.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _collapsed_tile(x_ptr, pre, tok, tok_ok, n, D, cols, NP: tl.constexpr):
    """Columns ``cols`` of the tokens' collapse by ``pre [BLOCK_T, NP]``, rounded to the dtype of ``x``
    (``_collapsed`` for a block of tokens)."""
    mask = tok_ok[:, None] & (cols[None, :] < D)
    acc = tl.zeros([tok.shape[0], cols.shape[0]], dtype=tl.float32)
    for k in range(n):
        xk = tl.load(x_ptr + (tok[:, None] * n + k) * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        weight = tl.sum(tl.where(tl.arange(0, NP)[None, :] == k, pre, 0.0), axis=1)
        acc += weight[:, None] * xk
    return acc.to(x_ptr.dtype.element_ty).to(tl.float32)


def _mix_layout(n: int) -> tuple[int, int]:
    """(NP, R_PAD): slots per row, padded; rows for comb, pre and post, padded to a dot width."""
    np_ = triton.next_power_of_2(n)
    width = runtime.dot_dim(np_ * (np_ + 2))
    return np_, width // np_


def _launch_mix(
    x: torch.Tensor,
    params: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    outs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    norm_eps: float,
    hc_eps: float,
    iters: int,
    head: bool,
    collapse: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, float] | None = None,
) -> None:
    """``collapse``: (its output ``[T, D]``, carry, the norm's weight, its eps), for ``hc_mix``."""
    t, n, d = x.shape
    if t == 0:
        return
    fn, base, scale = (p.contiguous() for p in params)
    np_, r_pad = _mix_layout(n)
    h, carry, weight, eps = collapse or (outs[0], None, None, 1.0)  # without it, never touched
    _hc_mix_tuned[lambda meta: _hc_mix_tuned.grid(triton.cdiv(t, meta["BLOCK_T"]))](
        x.contiguous(),
        fn,
        base,
        scale,
        *outs,
        outs[0] if carry is None else carry.contiguous(),
        outs[0] if weight is None else weight,
        h,
        t,
        n,
        n * d,
        norm_eps,
        hc_eps,
        iters,
        eps,
        HEAD=head,
        COLLAPSE=collapse is not None,
        CARRIED=carry is not None,
        WEIGHTED=weight is not None,
        NP=np_,
        R_PAD=r_pad,
    )


def hc_coeffs_triton(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t, n, _ = x.shape
    pre, post = (torch.empty((t, n), dtype=torch.float32, device=x.device) for _ in range(2))
    comb = torch.empty((t, n, n), dtype=torch.float32, device=x.device)
    _launch_mix(x, (fn, base, scale), (pre, post, comb), norm_eps, hc_eps, sinkhorn_iters, head=False)
    return pre, post, comb


def hc_mix_triton(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    input_weight: torch.Tensor | None,
    input_eps: float,
    carry: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    t, n, d = x.shape
    pre, post = (torch.empty((t, n), dtype=torch.float32, device=x.device) for _ in range(2))
    comb = torch.empty((t, n, n), dtype=torch.float32, device=x.device)
    h = torch.empty((t, d), dtype=x.dtype, device=x.device)
    collapse = (h, carry, input_weight, input_eps)
    _launch_mix(x, (fn, base, scale), (pre, post, comb), norm_eps, hc_eps, sinkhorn_iters, False, collapse)
    return pre, post, comb, h


def hc_head_coeffs_triton(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
) -> torch.Tensor:
    pre = torch.empty(x.shape[:2], dtype=torch.float32, device=x.device)
    # The head variant never touches post/comb; pre stands in for them.
    _launch_mix(x, (fn, base, scale), (pre, pre, pre), norm_eps, hc_eps, 1, head=True)
    return pre


@triton.jit
def _collapsed(x_ptr, pre_ptr, t, n, D, cols, col_ok):
    """Columns ``cols`` of token ``t``'s collapsed row, in fp32, rounded to the dtype of ``x``."""
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for k in range(n):
        xk = tl.load(x_ptr + (t * n + k) * D + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc += tl.load(pre_ptr + t * n + k) * xk
    return acc.to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit(do_not_specialize=["T"])
def _hc_collapse_kernel(
    x_ptr,
    pre_ptr,
    w_ptr,
    out_ptr,
    T,
    n,
    D,
    eps,
    NORM: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    if NORM:
        for t in range(pid, T, tl.num_programs(0)):
            sq = tl.zeros([BLOCK_D], dtype=tl.float32)
            for d0 in range(0, D, BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)
                y = _collapsed(x_ptr, pre_ptr, t, n, D, cols, cols < D)
                sq += y * y
            rstd = rms_factor(tl.sum(sq, axis=0), D, eps)
            for d0 in range(0, D, BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)
                y = _collapsed(x_ptr, pre_ptr, t, n, D, cols, cols < D) * rstd
                if WEIGHTED:
                    y = y * tl.load(w_ptr + cols, mask=cols < D, other=0.0)
                tl.store(out_ptr + t * D + cols, y.to(out_ptr.dtype.element_ty), mask=cols < D)
    else:
        d_tiles = tl.cdiv(D, BLOCK_D)
        for task in range(pid, T * d_tiles, tl.num_programs(0)):
            t = task // d_tiles
            cols = (task % d_tiles) * BLOCK_D + tl.arange(0, BLOCK_D)
            y = _collapsed(x_ptr, pre_ptr, t, n, D, cols, cols < D)
            tl.store(out_ptr + t * D + cols, y.to(out_ptr.dtype.element_ty), mask=cols < D)


def hc_collapse_triton(
    x: torch.Tensor, pre: torch.Tensor, norm_weight: torch.Tensor | None = None, norm_eps: float | None = None
) -> torch.Tensor:
    t, n, d = x.shape
    out = torch.empty((t, d), dtype=x.dtype, device=x.device)
    if t > 0:
        norm = norm_eps is not None
        tuned = _hc_collapse_tuned
        tuned[lambda meta: tuned.grid(t if norm else t * triton.cdiv(d, meta["BLOCK_D"]))](
            x.contiguous(),
            pre.contiguous(),
            pre if norm_weight is None else norm_weight,  # never read unweighted
            out,
            t,
            n,
            d,
            0.0 if norm_eps is None else norm_eps,
            NORM=norm,
            WEIGHTED=norm_weight is not None,
        )
    return out


@triton.jit(do_not_specialize=["T"])
def _hc_update_kernel(
    x_ptr, f_ptr, post_ptr, comb_ptr, out_ptr, T, n, D, NP: tl.constexpr, BLOCK_D: tl.constexpr
):
    pid = tl.program_id(0)
    d_tiles = tl.cdiv(D, BLOCK_D)
    jj = tl.arange(0, NP)
    j_ok = jj < n
    for task in range(pid, T * d_tiles, tl.num_programs(0)):
        t = task // d_tiles
        cols = (task % d_tiles) * BLOCK_D + tl.arange(0, BLOCK_D)
        col_ok = cols < D
        fv = tl.load(f_ptr + t * D + cols, mask=col_ok, other=0.0).to(tl.float32)
        post = tl.load(post_ptr + t * n + jj, mask=j_ok, other=0.0)
        acc = post[:, None] * fv[None, :]
        for i in range(n):
            xi = tl.load(x_ptr + (t * n + i) * D + cols, mask=col_ok, other=0.0).to(tl.float32)
            comb_row = tl.load(comb_ptr + (t * n + i) * n + jj, mask=j_ok, other=0.0)
            acc += comb_row[:, None] * xi[None, :]
        out = out_ptr + (t * n + jj[:, None]) * D + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=j_ok[:, None] & col_ok[None, :])


def hc_update_triton(
    x: torch.Tensor, f: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    t, n, d = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if t > 0:
        _hc_update_tuned[lambda meta: _hc_update_tuned.grid(t * triton.cdiv(d, meta["BLOCK_D"]))](
            x.contiguous(),
            f.contiguous(),
            post.contiguous(),
            comb.contiguous(),
            out,
            t,
            n,
            d,
            NP=triton.next_power_of_2(n),
        )
    return out


# Representative model values: n = 4 streams -> NP 4, R_PAD 8 (32 mix slots for m = 24).
_NP, _R_PAD = _mix_layout(4)


def _mix_ub(block_t: int, block_k: int) -> int:
    # x tile as loaded, its fp32 copy, squares and product, fn tile + its transpose, then about ten
    # [BLOCK_T, slots] tiles of activations and Sinkhorn (the lowered IR agrees within this bound).
    slots = _NP * _R_PAD
    return 4 * (4 * block_t * block_k + 2 * slots * block_k + 10 * block_t * slots)


_MIX_CONFIGS = (
    TuneConfig({"BLOCK_T": 16, "BLOCK_K": 64}, _mix_ub(16, 64)),
    TuneConfig({"BLOCK_T": 16, "BLOCK_K": 32}, _mix_ub(16, 32)),
)
# acc, loaded and fp32 tiles of one column block, the squares and the weight (collapse); the [NP, BLOCK_D]
# accumulator and its product term plus f and x rows (update).
_COLLAPSE_CONFIGS = tuple(TuneConfig({"BLOCK_D": bd}, 4 * 5 * bd) for bd in (512, 2048))
_UPDATE_CONFIGS = tuple(TuneConfig({"BLOCK_D": bd}, 4 * (2 * _NP * bd + 3 * bd)) for bd in (512, 2048))

_INTS = dict.fromkeys(("T", "n"), "i32")


def _mix_signature(x: str) -> dict[str, str]:
    names = ("fn_ptr", "base_ptr", "scale_ptr", "pre_ptr", "post_ptr", "comb_ptr", "carry_ptr", "w_ptr")
    ptrs = {**dict.fromkeys(names, "*fp32"), "h_ptr": x}
    scalars = {"norm_eps": "fp32", "hc_eps": "fp32", "iters": "i32", "input_eps": "fp32"}
    return {"x_ptr": x, **ptrs, **_INTS, "K": "i32", **scalars}


def _collapse_signature(x: str) -> dict[str, str]:
    return {
        "x_ptr": x,
        "pre_ptr": "*fp32",
        "w_ptr": "*fp32",
        "out_ptr": x,
        **_INTS,
        "D": "i32",
        "eps": "fp32",
    }


def _update_signature(x: str) -> dict[str, str]:
    coeffs = {"post_ptr": "*fp32", "comb_ptr": "*fp32"}
    return {"x_ptr": x, "f_ptr": x, **coeffs, "out_ptr": x, **_INTS, "D": "i32"}


_X = ("*fp32", "*bf16")
_hc_mix_tuned = tuning.TunedKernel(
    _hc_mix_kernel,
    _MIX_CONFIGS,
    key=["n", "K", "HEAD"],
    # The coefficients alone (the hc_head's too), and with the sublayer's input (V4's own pre, V4.1's
    # carry; its norm weighted).
    variants=tuple(
        Variant(
            {
                "HEAD": head,
                "COLLAPSE": collapse,
                "CARRIED": carried,
                "WEIGHTED": collapse,
                "NP": _NP,
                "R_PAD": _R_PAD,
            },
            tuple(_mix_signature(x) for x in _X),
        )  # fmt: skip
        for head, collapse, carried in ((0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 1, 1))
    ),
    uses_cube=True,
)
_hc_collapse_tuned = tuning.TunedKernel(
    _hc_collapse_kernel,
    _COLLAPSE_CONFIGS,
    key=["n", "D", "NORM"],
    variants=tuple(
        Variant({"NORM": norm, "WEIGHTED": norm}, tuple(_collapse_signature(x) for x in _X))
        for norm in (0, 1)
    ),
)
_hc_update_tuned = tuning.TunedKernel(
    _hc_update_kernel,
    _UPDATE_CONFIGS,
    key=["n", "D"],
    variants=(Variant({"NP": _NP}, tuple(_update_signature(x) for x in _X)),),
)
KERNELS = (_hc_mix_tuned, _hc_collapse_tuned, _hc_update_tuned)
