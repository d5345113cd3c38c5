"""RMSNorm, RoPE and mHC cases at the model's widths.

RMSNorm: the weighted norm of the hidden state and the unweighted per-head query norm. RoPE: the
queries, rotated on their last ``qk_rope_head_dim`` channels. mHC: the coefficients of a sublayer
(``x @ fn.T`` over ``hc_mult`` streams of the hidden state, then Sinkhorn), V4's final head
coefficients, and the collapse and update around every sublayer. Traffic: inputs and outputs once
(mHC's ``fn`` once per call); FLOPs of the mHC projection ``2·T·m·n·hidden``.
"""

from __future__ import annotations

import torch

from benchmarks.cases.case import Case, elements_bytes
from benchmarks.workload import Phase
from model.config import ModelConfig
from triton_kernels import mhc, rmsnorm, rope


def rmsnorm_cases(cfg: ModelConfig, phase: Phase, dev: torch.device, dtype: torch.dtype) -> list[Case]:
    gen = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(phase.total, cfg.hidden_size, generator=gen, device=dev).to(dtype)
    weight = torch.randn(cfg.hidden_size, generator=gen, device=dev)
    q = torch.randn(phase.total, cfg.num_attention_heads, cfg.head_dim, generator=gen, device=dev).to(dtype)
    eps = cfg.rms_norm_eps
    return [
        Case(
            "rmsnorm",
            "rms_norm hidden (weighted)",
            phase,
            lambda: rmsnorm.rms_norm_ref(hidden, weight, eps),
            lambda: rmsnorm.rms_norm_triton(hidden, weight, eps),
            2 * elements_bytes(hidden) + elements_bytes(weight),
        ),
        Case(
            "rmsnorm",
            "rms_norm query heads",
            phase,
            lambda: rmsnorm.rms_norm_ref(q, None, eps),
            lambda: rmsnorm.rms_norm_triton(q, None, eps),
            2 * elements_bytes(q),
        ),
    ]


def rope_cases(cfg: ModelConfig, phase: Phase, dev: torch.device, dtype: torch.dtype) -> list[Case]:
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(phase.total, cfg.num_attention_heads, cfg.head_dim, generator=gen, device=dev).to(dtype)
    positions = torch.arange(phase.total, dtype=torch.int32, device=dev) + phase.context - phase.tokens
    inv_freq = rope.rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta).to(dev)
    return [
        Case(
            "rope",
            "apply_rope queries",
            phase,
            lambda: rope.apply_rope_ref(q, positions, inv_freq),
            lambda: rope.apply_rope_triton(q, positions, inv_freq),
            2 * elements_bytes(q) + elements_bytes(positions, inv_freq),
        )
    ]


def mhc_cases(cfg: ModelConfig, phase: Phase, dev: torch.device, dtype: torch.dtype) -> list[Case]:
    gen = torch.Generator(device=dev).manual_seed(0)
    t, n, d, m = phase.total, cfg.hc_mult, cfg.hidden_size, cfg.mix_width
    x = torch.randn(t, n, d, generator=gen, device=dev).to(dtype)
    fn = torch.randn(m, n * d, generator=gen, device=dev) * (n * d) ** -0.5
    base, scale = torch.randn(m, generator=gen, device=dev), torch.rand(3, generator=gen, device=dev)
    eps = {"norm_eps": cfg.rms_norm_eps, "hc_eps": cfg.hc_eps}
    coeffs = (x, fn, base, scale)
    iters = cfg.hc_sinkhorn_iters
    pre, post, comb = mhc.hc_coeffs_ref(*coeffs, **eps, sinkhorn_iters=iters)
    f = torch.randn(t, d, generator=gen, device=dev).to(dtype)
    sublayer_input = {
        "input_weight": torch.rand(d, generator=gen, device=dev) + 0.5,
        "input_eps": cfg.rms_norm_eps,
    }
    cases = [
        Case(
            "mhc",
            "hc_coeffs",
            phase,
            lambda: mhc.hc_coeffs_ref(*coeffs, **eps, sinkhorn_iters=iters),
            lambda: mhc.hc_coeffs_triton(*coeffs, **eps, sinkhorn_iters=iters),
            elements_bytes(x, fn, pre, post, comb),
            2 * t * m * n * d,
        ),
        Case(
            "mhc",
            "hc_mix",  # what a block runs: the coefficients and the sublayer's normed input
            phase,
            lambda: mhc.hc_mix_ref(*coeffs, **eps, sinkhorn_iters=iters, **sublayer_input),
            lambda: mhc.hc_mix_triton(*coeffs, **eps, sinkhorn_iters=iters, **sublayer_input),
            elements_bytes(x, fn, pre, post, comb, f),
            2 * t * m * n * d,
        ),
        Case(
            "mhc",
            "hc_collapse",
            phase,
            lambda: mhc.hc_collapse_ref(x, pre),
            lambda: mhc.hc_collapse_triton(x, pre),
            elements_bytes(x, pre, f),
        ),
        Case(
            "mhc",
            "hc_update",
            phase,
            lambda: mhc.hc_update_ref(x, f, post, comb),
            lambda: mhc.hc_update_triton(x, f, post, comb),
            2 * elements_bytes(x) + elements_bytes(f, post, comb),
        ),
    ]
    if cfg.is_v41:  # V4.1 has no final head coefficients
        return cases
    head = (x, fn[:n], base[:n], scale[:1])
    return cases + [
        Case(
            "mhc",
            "hc_head_coeffs",
            phase,
            lambda: mhc.hc_head_coeffs_ref(*head, **eps),
            lambda: mhc.hc_head_coeffs_triton(*head, **eps),
            elements_bytes(x, fn[:n], pre),
            2 * t * n * n * d,
        )
    ]
