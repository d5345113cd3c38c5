"""Weight-quantised GEMM and routed-expert cases at the model's widths, over random stored bytes.

``quant_matmul``: the query down-projection ``wq_a`` ``[q_lora_rank, hidden]`` as FP8 with the model's
block (128 for V4, 32 for V4.1 when the config names none) and as W8A8, and one routed expert's ``w1``
``[moe_intermediate_size, hidden]`` as MXFP4. ``moe_gemm``: the phase's tokens over all routed experts
(MXFP4, W8A8 and W4A8), each choosing ``num_experts_per_tok`` distinct experts at random, and the shared
expert's SwiGLU over the phase's tokens. Traffic:
activations, the packed bytes and exponents of every weight read (for the MoE, of the experts chosen),
outputs once;
FLOPs ``2·T·N·K`` per GEMM (three per chosen expert).
"""

from __future__ import annotations

import torch

from benchmarks.cases.case import Case, elements_bytes
from benchmarks.workload import Phase
from model.config import ModelConfig
from triton_kernels import moe_gemm, quant_matmul
from triton_kernels.quant import quantize_int8_ref
from triton_kernels.quant_matmul import QuantWeight


def random_weight(
    fmt: str,
    n: int,
    k: int,
    seed: int = 0,
    experts: tuple[int, ...] = (),
    exponents: tuple[int, int] = (120, 134),
    device: torch.device | str = "cpu",
) -> QuantWeight:
    """Random stored bytes of ``fmt`` (``fp8-128``, ``fp8-32``, ``mxfp4``, ``int8``, ``int4`` or ``dense``):
    every finite code, subnormals included, with E8M0 exponents in ``exponents``; ``experts=(E,)`` stacks E
    of them."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def ints(low: int, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(low, high, (*experts, *shape), generator=gen, device=device, dtype=torch.uint8)

    if fmt.startswith("fp8"):
        block = int(fmt.split("-")[1])
        data = ints(0, 256, n, k)
        data[(data & 127) == 127] = 0x38  # NaN codes -> 1.0
        return quant_matmul.fp8_weight(data, ints(*exponents, -(-n // block), -(-k // block)), block)
    if fmt == "mxfp4":
        return quant_matmul.mxfp4_weight(ints(0, 256, n, k // 2), ints(*exponents, n, -(-k // 32)))
    w = torch.randn((*experts, n, k), generator=gen, device=device) / k**0.5
    if fmt == "dense":
        return quant_matmul.dense_weight(w)
    if fmt == "int4":  # every signed nibble, a per-channel scale of unit-variance weights
        scale = torch.rand((*experts, n, 1), generator=gen, device=device) * 0.1 + 0.05
        return quant_matmul.int4_weight(ints(0, 256, n // 2, k).view(torch.int8), scale / k**0.5)
    q, scale = quantize_int8_ref(w)
    return quant_matmul.int8_weight(q, scale)


def _weight_bytes(w: QuantWeight) -> int:
    return elements_bytes(w.data, w.scale)


def quant_matmul_cases(cfg: ModelConfig, phase: Phase, dev: torch.device, dtype: torch.dtype) -> list[Case]:
    x = torch.randn(
        phase.total, cfg.hidden_size, generator=torch.Generator(device=dev).manual_seed(0), device=dev
    )
    x = x.to(dtype)
    block = cfg.fp8_block or (32 if cfg.is_v41 else 128)
    weights = {
        f"wq_a fp8 block {block}": random_weight(
            f"fp8-{block}", cfg.q_lora_rank, cfg.hidden_size, device=dev
        ),
        "wq_a w8a8": random_weight("int8", cfg.q_lora_rank, cfg.hidden_size, device=dev),
        "expert w1 mxfp4": random_weight("mxfp4", cfg.moe_intermediate_size, cfg.hidden_size, device=dev),
    }
    return [
        Case(
            "quant_matmul",
            name,
            phase,
            lambda w=w: quant_matmul.quant_matmul_ref(x, w),
            lambda w=w: quant_matmul.quant_matmul_triton(x, w),
            elements_bytes(x) + phase.total * w.out_features * x.element_size() + _weight_bytes(w),
            2 * phase.total * w.out_features * w.in_features,
            int8=w.format == quant_matmul.INT8,
        )
        for name, w in weights.items()
    ]


def moe_gemm_cases(cfg: ModelConfig, phase: Phase, dev: torch.device, dtype: torch.dtype) -> list[Case]:
    gen = torch.Generator(device=dev).manual_seed(0)
    e, k, d, inter = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    x = torch.randn(phase.total, d, generator=gen, device=dev).to(dtype)
    ids = torch.rand(phase.total, e, generator=gen, device=dev).argsort(dim=1)[:, :k].int()
    weights = torch.rand(phase.total, k, generator=gen, device=dev)
    chosen = int(ids.unique().numel())
    cases = []
    for fmt in ("mxfp4", "int8", "int4"):  # the release, msModelSlim W8A8 and V4-Pro's W4A8 experts
        w1, w3, w2 = (random_weight(fmt, n, m, seed, (e,), (114, 120), dev) for n, m, seed in
                      ((inter, d, 1), (inter, d, 2), (d, inter, 3)))  # fmt: skip
        experts = moe_gemm.RoutedExperts(w1, w3, w2, cfg.swiglu_limit)
        per_expert = sum(_weight_bytes(w) for w in (w1, w3, w2)) // e
        cases.append(
            Case(
                "moe_gemm",
                f"routed experts {fmt} ({e} experts, top {k})",
                phase,
                lambda experts=experts: moe_gemm.moe_gemm_ref(x, ids, weights, experts),
                lambda experts=experts: moe_gemm.moe_gemm_triton(x, ids, weights, experts),
                2 * elements_bytes(x) + elements_bytes(ids, weights) + chosen * per_expert,
                6 * phase.total * k * inter * d,
                int8=fmt in quant_matmul.INTEGER_FORMATS,
            )
        )
    gate, up = (torch.randn(phase.total, inter, generator=gen, device=dev).to(dtype) for _ in range(2))
    limit = cfg.swiglu_limit
    cases.append(
        Case(
            "moe_gemm",
            "shared expert swiglu",
            phase,
            lambda: moe_gemm.swiglu_ref(gate, up, limit),
            lambda: moe_gemm.swiglu_triton(gate, up, limit),
            3 * elements_bytes(gate),
        )
    )
    return cases
