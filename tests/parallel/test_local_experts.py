"""A rank's routed experts are one stacked module in their stored format: over the ranks, the local
experts' outputs add up to the whole layer's, and each rank computes only the choices routed to it."""

from __future__ import annotations

import pytest
import torch

from model.checkpoint import load_model
from model.moe import MoE
from model.parallel.context import ParallelContext
from model.parallel.modules import ExpertParallelMoE, LocalExperts
from model.testing.tiny import cached_tiny
from triton_kernels import moe_gemm

WORLD = 2


@pytest.mark.parametrize("fp8", [False, True])
def test_local_experts_sum_to_the_whole_layer_and_skip_other_ranks_choices(
    fp8_tiny, fp8: bool, monkeypatch: pytest.MonkeyPatch
):
    """Dense experts, and MXFP4 ones kept packed."""
    path = fp8_tiny if fp8 else cached_tiny("v4")
    whole = load_model(path)
    moe = next(m for m in whole.modules() if isinstance(m, MoE))
    prefix = next(n for n, m in whole.named_modules() if m is moe)
    x = torch.randn(7, moe.shape[1], generator=torch.Generator().manual_seed(0))
    picked, weights = moe.gate(x, torch.arange(7))
    computed = []
    real = moe_gemm.moe_gemm_ref

    def counting(x, ids, w, experts, shared=None):
        computed.append(int(((ids >= 0) & (ids < experts.num_experts)).sum()))
        return real(x, ids, w, experts, shared)

    monkeypatch.setattr(moe_gemm, "moe_gemm_ref", counting)
    total = torch.zeros(7, moe.shape[1])
    for rank in range(WORLD):
        part = load_model(path, parallel=ParallelContext(rank, WORLD))
        local = part.get_submodule(prefix)
        assert isinstance(local, ExpertParallelMoE) and isinstance(local.experts, LocalExperts)
        assert local.experts.format == moe.experts.format == ("mxfp4" if fp8 else "dense")
        total += local.experts(x, picked, weights)
    assert computed == [int((picked // (moe.shape[0] // WORLD) == r).sum()) for r in range(WORLD)]
    assert sum(computed) == picked.numel()
    torch.testing.assert_close(total, moe.experts(x, picked, weights), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rank", range(WORLD))
def test_the_kernel_skips_other_ranks_choices_as_the_reference_does(rank: int):
    """The shifted choices (rank 0: past its last expert; rank 1: negative) through the Triton kernel."""
    path = cached_tiny("v4")
    part = load_model(path, parallel=ParallelContext(rank, WORLD))
    local = next(m for m in part.modules() if isinstance(m, ExpertParallelMoE))
    x = torch.randn(5, local.experts.shape[1], generator=torch.Generator().manual_seed(1))
    picked, weights = local.gate(x, torch.arange(5))
    shifted, routed = picked - local.experts.first, local.experts.routed()
    mine = (shifted >= 0) & (shifted < routed.num_experts)
    assert mine.any() and not mine.all()
    expected = moe_gemm.moe_gemm_ref(x, shifted, weights, routed)
    torch.testing.assert_close(moe_gemm.moe_gemm_triton(x, shifted, weights, routed), expected)
