"""Random packed weights for the quant_matmul and moe_gemm tests: the stored bytes, not quantised values."""

from __future__ import annotations

import torch

from triton_kernels.quant import quantize_int8_ref
from triton_kernels.quant_matmul import QuantWeight, fp8_weight, int8_weight, mxfp4_weight


def random_weight(
    fmt: str,
    n: int,
    k: int,
    seed: int = 0,
    experts: tuple[int, ...] = (),
    exponents: tuple[int, int] = (120, 134),
) -> QuantWeight:
    """Every finite code (subnormals included) with E8M0 exponents in ``exponents``; ``experts=(E,)`` stacks.
    ``fmt``: ``fp8-128``, ``fp8-32``, ``mxfp4`` or ``int8``."""
    gen = torch.Generator().manual_seed(seed)

    def scale(*shape: int) -> torch.Tensor:
        return torch.randint(*exponents, (*experts, *shape), generator=gen, dtype=torch.uint8)

    if fmt.startswith("fp8"):
        block = int(fmt.split("-")[1])
        data = torch.randint(0, 256, (*experts, n, k), generator=gen, dtype=torch.uint8)
        data[(data & 127) == 127] = 0x38  # NaN codes -> 1.0
        return fp8_weight(data.view(torch.float8_e4m3fn), scale(-(-n // block), -(-k // block)), block)
    if fmt == "mxfp4":
        data = torch.randint(-128, 128, (*experts, n, k // 2), generator=gen, dtype=torch.int8)
        return mxfp4_weight(data, scale(n, -(-k // 32)).view(torch.float8_e8m0fnu))
    q, s = quantize_int8_ref(torch.randn(n, k, generator=gen))
    return int8_weight(q, s[:, None])


def assert_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32 rounding of K-term sums, relative to the largest output (random codes cancel a lot)."""
    if out.dtype == torch.bfloat16:
        torch.testing.assert_close(out, expected)
    else:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
