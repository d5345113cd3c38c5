"""What the quant_matmul and moe_gemm tests share: random stored bytes (from the benchmarks), tolerances."""

from __future__ import annotations

import torch

from benchmarks.cases.quant_gemm import random_weight

__all__ = ["assert_close", "random_weight"]


def assert_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32 rounding of K-term sums, relative to the largest output (random codes cancel a lot)."""
    if out.dtype == torch.bfloat16:
        torch.testing.assert_close(out, expected)
    else:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
