"""RMSNorm over the last dimension, weighted or not (every norm of DeepSeek V4).

Contract
    ``rms_norm(x [..., N], weight [N] fp32 | None, eps) -> [..., N]``, dtype of ``x`` (fp32 or bf16).
    ``y = x * rsqrt(mean(x**2) + eps) * weight`` in fp32, cast to the dtype of ``x`` once at the end
    (the checkpoints keep norm weights in fp32). ``weight=None`` is the unweighted norm (V4's
    per-head query norm, the mHC input norm); for bf16 input it rounds once, where transformers'
    unweighted module multiplies in bf16.

Kernel
    One task is ``BLOCK_M`` rows. A row is swept twice in ``BLOCK_N`` sub-tiles (sum of squares,
    then scale and store), so a 7168-wide hidden row never has to fit the unified buffer whole.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_kernels import runtime, tuning
from triton_kernels.shared import rms_factor
from triton_kernels.spec import TuneConfig, Variant

_DTYPES = (torch.float32, torch.bfloat16)
_MAX_NUMEL = 2**31 - 1  # offsets are int32 inside the kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    validate_norm(x, weight, eps)
    if runtime.use_triton(x):
        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def validate_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> None:
    """``rms_norm``'s checks of its arguments (also those of a norm fused into another op)."""
    if x.dtype not in _DTYPES:
        raise ValueError(f"x: dtype {x.dtype} not supported, expected one of {_DTYPES}")
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"x: shape {tuple(x.shape)} must have a non-empty last dimension")
    if x.numel() > _MAX_NUMEL:
        raise ValueError(f"x: {x.numel()} elements exceeds the limit {_MAX_NUMEL}")
    if weight is not None:
        if weight.shape != x.shape[-1:]:
            raise ValueError(
                f"weight: shape {tuple(weight.shape)} must be ({x.shape[-1]},), the last dim of x"
            )
        if weight.dtype != torch.float32:
            raise ValueError(f"weight: dtype {weight.dtype} not supported, expected torch.float32")
        if weight.device != x.device:
            raise ValueError(f"weight: device {weight.device} differs from x's device {x.device}")
    if not eps > 0:
        raise ValueError(f"eps: {eps} must be > 0")


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``weight * x * rsqrt(mean(x**2) + eps)`` in fp32 over the last dim: torch's fused op computes it
    in that order, bit for bit like the separate ops."""
    return torch.nn.functional.rms_norm(x.float(), x.shape[-1:], weight, eps).to(x.dtype)


@triton.jit(do_not_specialize=["M"])
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    stride_x,
    eps,
    HAS_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    for task in range(pid, tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = task * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        x_rows = x_ptr + rows[:, None] * stride_x
        sq = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            mask = row_ok[:, None] & (cols[None, :] < N)
            xv = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            sq += xv * xv
        rstd = rms_factor(tl.sum(sq, axis=1), N, eps)
        for n0 in range(0, N, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            mask = row_ok[:, None] & (cols[None, :] < N)
            y = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32) * rstd[:, None]
            if HAS_WEIGHT:
                y = y * tl.load(w_ptr + cols, mask=cols < N, other=0.0)[None, :]
            tl.store(out_ptr + rows[:, None] * N + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m > 0:
        # Without a weight the kernel never reads w_ptr; x stands in for it.
        w = x2 if weight is None else weight
        _rms_norm_tuned[lambda meta: _rms_norm_tuned.grid(triton.cdiv(m, meta["BLOCK_M"]))](
            x2, w, out, m, n, x2.stride(0), eps, HAS_WEIGHT=weight is not None
        )
    return out.view(x.shape)


def _ub_bytes(block_m: int, block_n: int) -> int:
    # x tile as loaded, its fp32 copy, the squares accumulator and the output tile, plus the weight.
    return 4 * (4 * block_m * block_n + block_n)


_CONFIGS = tuple(
    TuneConfig({"BLOCK_M": bm, "BLOCK_N": bn}, _ub_bytes(bm, bn))
    for bm, bn in ((1, 4096), (4, 1024), (16, 256))
)


def _signature(x: str, w: str) -> dict[str, str]:
    return {"x_ptr": x, "w_ptr": w, "out_ptr": x, "M": "i32", "N": "i32", "stride_x": "i32", "eps": "fp32"}


_rms_norm_tuned = tuning.TunedKernel(
    _rms_norm_kernel,
    _CONFIGS,
    key=["N"],
    variants=(
        Variant({"HAS_WEIGHT": 1}, (_signature("*fp32", "*fp32"), _signature("*bf16", "*fp32"))),
        Variant({"HAS_WEIGHT": 0}, (_signature("*fp32", "*fp32"), _signature("*bf16", "*bf16"))),
    ),
)
KERNELS = (_rms_norm_tuned,)
