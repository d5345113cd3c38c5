from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from triton_kernels import quant, runtime
from triton_kernels.quant import dequantize_int8, quantize_int8, quantize_int8_ref, quantize_int8_triton


def _x(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


def test_reference_rounds_halves_away_from_zero() -> None:
    x = torch.tensor([[63.5, 0.5, -0.5, 1.5, -1.5, 2.5, 0.0, -63.5]])  # scale 0.5: quotients 127, 1, ...
    q, scale = quantize_int8_ref(x)
    assert scale.tolist() == [0.5]
    assert q.tolist() == [[127, 1, -1, 3, -3, 5, 0, -127]]
    q, scale = quantize_int8_ref(torch.zeros(2, 8))
    assert scale.tolist() == [0.0, 0.0] and q.eq(0).all()


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 50), d=st.sampled_from([1, 7, 32, 128, 1000]), seed=st.integers(0, 2**16))
def test_reference_round_trip_within_half_a_step(rows: int, d: int, seed: int) -> None:
    x = _x((rows, d), seed=seed)
    q, scale = quantize_int8_ref(x)
    assert q.abs().amax(-1).eq(127).all()  # the largest magnitude of a row maps to 127
    err = (dequantize_int8(q, scale) - x).abs()
    assert torch.all(err <= scale[:, None] * (0.5 + 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 4, 32), (33, 128), (3, 1000), (1, 1), (0, 16)])
def test_kernel_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = _x(shape, dtype)
    if x.numel():
        x.view(-1, shape[-1])[0] = 0  # an all-zero row
    q, scale = quantize_int8_triton(x)
    q_ref, scale_ref = quantize_int8_ref(x)
    assert q.shape == x.shape and q.dtype == torch.int8 and scale.shape == x.shape[:-1]
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)


def test_public_op_dispatches(monkeypatch: pytest.MonkeyPatch) -> None:
    x = _x((4, 2, 64))
    on_cpu = quantize_int8(x)
    monkeypatch.setattr(runtime, "use_triton", lambda t: True)
    assert all(torch.equal(a, b) for a, b in zip(quantize_int8(x), on_cpu, strict=True))


@pytest.mark.parametrize(
    ("x", "match"),
    [
        (torch.zeros(2, 8, dtype=torch.float16), "x: dtype torch.float16"),
        (torch.zeros(()), r"x: shape \(\) must have a last dimension in \[1, 1024\]"),
        (torch.zeros(2, 2048), r"x: shape \(2, 2048\)"),
    ],
)
def test_validation(x: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        quantize_int8(x)


def test_empty_input_does_not_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quant, "_quantize_tuned", None)  # any launch would fail
    q, scale = quantize_int8_triton(torch.zeros(0, 3, 16))
    assert q.shape == (0, 3, 16) and scale.shape == (0, 3)
