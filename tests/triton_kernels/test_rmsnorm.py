from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4RMSNorm,
    DeepseekV4UnweightedRMSNorm,
)

from triton_kernels import rmsnorm, runtime
from triton_kernels.rmsnorm import rms_norm, rms_norm_ref, rms_norm_triton

EPS = 1e-6


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    return x, torch.randn(shape[-1], generator=gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_transformers(dtype: torch.dtype) -> None:
    x, w = _inputs((2, 5, 96), dtype)
    norm = DeepseekV4RMSNorm(96, eps=EPS)
    norm.weight.data.copy_(w)
    torch.testing.assert_close(rms_norm_ref(x, w, EPS), norm(x), rtol=0, atol=0)
    x32 = x.float()
    torch.testing.assert_close(rms_norm_ref(x32, None, EPS), DeepseekV4UnweightedRMSNorm(EPS)(x32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "unweighted"])
@pytest.mark.parametrize("shape", [(1, 7168), (3, 5, 100), (33, 64), (0, 64), (4, 1)])
def test_kernel_matches_reference(shape: tuple[int, ...], weighted: bool, dtype: torch.dtype) -> None:
    x, w = _inputs(shape, dtype)
    w = w if weighted else None
    out = rms_norm_triton(x, w, EPS)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, rms_norm_ref(x, w, EPS))


def test_kernel_reads_strided_rows() -> None:
    wide, w = _inputs((6, 80), torch.float32)
    x = wide[:, 8:72]  # row stride 80, not the row length
    torch.testing.assert_close(rms_norm_triton(x, w[8:72], EPS), rms_norm_ref(x, w[8:72], EPS))


@settings(max_examples=12, deadline=None)
@given(
    rows=st.integers(1, 40),
    n=st.sampled_from([1, 7, 31, 64, 257, 1000]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_reference_random(rows: int, n: int, dtype: torch.dtype, seed: int) -> None:
    x, w = _inputs((rows, n), dtype, seed)
    torch.testing.assert_close(rms_norm_triton(x, w, EPS), rms_norm_ref(x, w, EPS))


def test_public_op_dispatches(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w = _inputs((3, 64), torch.float32)
    assert torch.equal(rms_norm(x, w, EPS), rms_norm_ref(x, w, EPS))
    monkeypatch.setattr(runtime, "use_triton", lambda t: True)
    torch.testing.assert_close(rms_norm(x, w, EPS), rms_norm_ref(x, w, EPS))


@pytest.mark.parametrize(
    ("x", "weight", "eps", "match"),
    [
        (torch.zeros(2, 8, dtype=torch.float16), None, EPS, "x: dtype"),
        (torch.zeros(()), None, EPS, "x: shape"),
        (torch.zeros(2, 0), None, EPS, "x: shape"),
        (torch.zeros(2, 8), torch.ones(7), EPS, r"weight: shape \(7,\) must be \(8,\)"),
        (torch.zeros(2, 8), torch.ones(8, dtype=torch.bfloat16), EPS, "weight: dtype"),
        (torch.zeros(2, 8), torch.ones(8, device="meta"), EPS, "weight: device"),
        (torch.zeros(2, 8), None, 0.0, "eps: 0.0 must be > 0"),
    ],
)
def test_validation(x: torch.Tensor, weight: torch.Tensor | None, eps: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        rms_norm(x, weight, eps)


def test_empty_input_does_not_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rmsnorm, "_rms_norm_tuned", None)  # any launch would fail
    assert rms_norm_triton(torch.zeros(0, 3, 16), torch.ones(16), EPS).shape == (0, 3, 16)
