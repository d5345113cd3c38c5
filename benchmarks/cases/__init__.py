"""Per-operator cases at model-derived shapes, keyed by op module name (``triton_kernels.<op>``)."""

from __future__ import annotations

# The op modules below must see the interpreter switch before triton decorates their kernels.
import benchmarks.common  # noqa: F401

# isort: split

from benchmarks.cases.attention import attention_cases, compressor_cases
from benchmarks.cases.case import Builder, Case
from benchmarks.cases.engram import engram_cases
from benchmarks.cases.indexer import indexer_cases, quant_cases, topk_cases
from benchmarks.cases.layers import mhc_cases, rmsnorm_cases, rope_cases
from benchmarks.cases.quant_gemm import moe_gemm_cases, quant_matmul_cases
from triton_kernels import ops

_BUILDERS: dict[str, Builder] = {
    "rmsnorm": rmsnorm_cases,
    "rope": rope_cases,
    "mhc": mhc_cases,
    "quant": quant_cases,
    "topk": topk_cases,
    "indexer": indexer_cases,
    "sparse_attn": attention_cases,
    "compressor": compressor_cases,
    "engram": engram_cases,
    "quant_matmul": quant_matmul_cases,
    "moe_gemm": moe_gemm_cases,
}
# In the registry's order; ops with no cases yet (router, engram_gate, paging, kv_store) are not benchmarked.
OPS: dict[str, Builder] = {op: _BUILDERS[op] for op in ops.OPS if op in _BUILDERS}

__all__ = ["OPS", "Builder", "Case", "select"]


def select(spec: str) -> list[str]:
    """``all`` or a comma-separated list of op names, validated."""
    names = list(OPS) if spec == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in OPS]
    if unknown or not names:
        raise ValueError(f"--ops: {spec!r} names unknown ops {unknown} (known: all, {', '.join(OPS)})")
    return names
