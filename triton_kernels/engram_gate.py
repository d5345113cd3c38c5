"""The Engram gate (DeepSeek V4.1, model-spec §6.4): each stream takes the retrieved memory in by a gate
from its agreement with the retrieved key.

Contract
    ``engram_gate(x [S, n, D] fp32 | bf16, kv [S, (n + 1) * D] fp32, q_weight, k_weight [n, D] fp32, eps,
    dead [S] bool | None) -> [S, n, D]``, dtype of ``x``, fp32 maths; ``key = kv[:, :n*D].view(S, n, D)``,
    ``val = kv[:, n*D:]``::

        dot[s, j] = sum_d x * q_weight * k_weight * key                       (products left to right)
                    * rsqrt(mean(x**2) + eps) * rsqrt(mean(key**2) + eps) * D**-0.5
        gate = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6)))                   0 where dead[s]
        out[s, j] = x[s, j] + gate[s, j] * val[s]

Kernel
    One task is one (token, stream) row, swept twice in ``BLOCK_D`` sub-tiles: the three sums, then the
    output; the gate is a scalar between the sweeps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_kernels import runtime, tuning
from triton_kernels.spec import TuneConfig, Variant

_DTYPES = (torch.float32, torch.bfloat16)
_MAX_NUMEL = 2**31 - 1
_DOT_FLOOR = 1e-6


def engram_gate(
    x: torch.Tensor,
    kv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    dead: torch.Tensor | None = None,
) -> torch.Tensor:
    _validate(x, kv, q_weight, k_weight, eps, dead)
    run = engram_gate_triton if runtime.use_triton(x) else engram_gate_ref
    return run(x, kv, q_weight, k_weight, eps, dead)


def _validate(
    x: torch.Tensor,
    kv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    dead: torch.Tensor | None,
) -> None:
    if x.dtype not in _DTYPES or x.dim() != 3:
        raise ValueError(f"x: {x.dtype} {tuple(x.shape)} must be [S, n, D] of {_DTYPES}")
    s, n, d = x.shape
    if kv.dtype != torch.float32 or kv.shape != (s, (n + 1) * d):
        raise ValueError(f"kv: {kv.dtype} {tuple(kv.shape)} must be torch.float32 {(s, (n + 1) * d)}")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.dtype != torch.float32 or w.shape != (n, d):
            raise ValueError(f"{name}: {w.dtype} {tuple(w.shape)} must be torch.float32 {(n, d)}")
    if dead is not None and (dead.dtype != torch.bool or dead.shape != (s,)):
        raise ValueError(f"dead: {dead.dtype} {tuple(dead.shape)} must be torch.bool ({s},)")
    if not eps > 0:
        raise ValueError(f"eps: {eps} must be > 0")
    tensors = (kv, q_weight, k_weight) if dead is None else (kv, q_weight, k_weight, dead)
    if any(t.device != x.device for t in tensors):
        raise ValueError(f"kv / q_weight / k_weight / dead: devices must be x's {x.device}")
    if kv.numel() > _MAX_NUMEL:
        raise ValueError(f"kv: {kv.numel()} elements exceeds the limit {_MAX_NUMEL}")


def engram_gate_ref(
    x: torch.Tensor,
    kv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    dead: torch.Tensor | None = None,
) -> torch.Tensor:
    s, n, d = x.shape
    key, val = kv[:, : n * d].view(s, n, d), kv[:, n * d :]
    xf = x.float()
    dot = (xf * q_weight * k_weight * key).sum(-1)
    dot = dot * torch.rsqrt(xf.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = dot * d**-0.5
    gate = torch.sigmoid(dot.sign() * dot.abs().clamp_min(_DOT_FLOOR).sqrt())
    if dead is not None:
        gate = gate.masked_fill(dead[:, None], 0.0)
    return (xf + gate[:, :, None] * val[:, None, :]).to(x.dtype)


@triton.jit(do_not_specialize=["S"])
def _engram_gate_kernel(
    x_ptr,
    kv_ptr,
    qw_ptr,
    kw_ptr,
    dead_ptr,
    out_ptr,
    S,
    n,
    D,
    eps,
    DEAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    for task in range(tl.program_id(0), S * n, tl.num_programs(0)):
        s, j = task // n, task % n
        x_row, key_row = x_ptr + task * D, kv_ptr + s * (n + 1) * D + j * D
        dots = tl.zeros([BLOCK_D], dtype=tl.float32)
        x_sq = tl.zeros([BLOCK_D], dtype=tl.float32)
        key_sq = tl.zeros([BLOCK_D], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            ok = cols < D
            xv = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
            key = tl.load(key_row + cols, mask=ok, other=0.0)
            qw = tl.load(qw_ptr + j * D + cols, mask=ok, other=0.0)
            kw = tl.load(kw_ptr + j * D + cols, mask=ok, other=0.0)
            dots += xv * qw * kw * key
            x_sq += xv * xv
            key_sq += key * key
        dot = tl.sum(dots, axis=0) / tl.sqrt(tl.sum(x_sq, axis=0) / D + eps)
        dot = dot / tl.sqrt(tl.sum(key_sq, axis=0) / D + eps) / tl.sqrt(D * 1.0)
        sign = tl.where(dot > 0, 1.0, tl.where(dot < 0, -1.0, 0.0))
        gate = 1.0 / (1.0 + tl.exp(-sign * tl.sqrt(tl.maximum(tl.abs(dot), 1e-6))))
        if DEAD:
            gate = tl.where(tl.load(dead_ptr + s).to(tl.int32) != 0, 0.0, gate)
        val_row = kv_ptr + s * (n + 1) * D + n * D
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            ok = cols < D
            xv = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
            val = tl.load(val_row + cols, mask=ok, other=0.0)
            tl.store(out_ptr + task * D + cols, (xv + gate * val).to(out_ptr.dtype.element_ty), mask=ok)


def engram_gate_triton(
    x: torch.Tensor,
    kv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    dead: torch.Tensor | None = None,
) -> torch.Tensor:
    s, n, d = x.shape
    out = torch.empty_like(x)
    if s:
        tuned = _gate_tuned
        tuned[lambda meta: tuned.grid(s * n)](
            x.contiguous(),
            kv.contiguous(),
            q_weight.contiguous(),
            k_weight.contiguous(),
            kv if dead is None else dead,  # never read without dead positions
            out,
            s,
            n,
            d,
            eps,
            DEAD=dead is not None,
        )
    return out


def _signature(x: str, dead: str) -> dict[str, str]:
    pointers = {"x_ptr": x, "kv_ptr": "*fp32", "qw_ptr": "*fp32", "kw_ptr": "*fp32", "dead_ptr": dead}
    return {**pointers, "out_ptr": x, "S": "i32", "n": "i32", "D": "i32", "eps": "fp32"}


# Per column: the x tile as loaded and in fp32, the key, both weights, the three sums, then val and out.
_CONFIGS = tuple(TuneConfig({"BLOCK_D": b}, 10 * 4 * b) for b in (512, 1024))
_gate_tuned = tuning.TunedKernel(
    _engram_gate_kernel,
    _CONFIGS,
    key=["D"],
    variants=(
        Variant({"DEAD": 0}, (_signature("*fp32", "*fp32"), _signature("*bf16", "*fp32"))),
        Variant({"DEAD": 1}, (_signature("*fp32", "*i1"), _signature("*bf16", "*i1"))),
    ),
)
KERNELS = (_gate_tuned,)
