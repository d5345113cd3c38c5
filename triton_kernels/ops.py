"""The operators: one module each (contract, torch reference, Triton kernels, their ``KERNELS``
declarations), listed once here for everything that walks them: the runtime tests, the benchmarks and
the autotuner (their cases are keyed by these names) and the Ascend gate."""

from __future__ import annotations

from types import ModuleType

from triton_kernels import (
    compressor,
    engram,
    engram_gate,
    indexer,
    kv_store,
    mhc,
    moe_gemm,
    paging,
    quant,
    quant_matmul,
    rmsnorm,
    rope,
    router,
    sparse_attn,
    topk,
)
from triton_kernels.tuning import TunedKernel

# By op name (the module's), in the order the benchmarks report them.
OPS: dict[str, ModuleType] = {
    module.__name__.rpartition(".")[2]: module
    for module in (
        rmsnorm,
        rope,
        mhc,
        quant,
        topk,
        indexer,
        sparse_attn,
        compressor,
        engram,
        engram_gate,
        quant_matmul,
        router,
        moe_gemm,
        paging,
        kv_store,
    )  # fmt: skip
}


def declared_kernels() -> list[tuple[str, TunedKernel]]:
    """Every op's declared kernels, with the op's name."""
    return [(name, tuned) for name, module in OPS.items() for tuned in module.KERNELS]
