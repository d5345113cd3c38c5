from __future__ import annotations

import math

import pytest
import torch

from triton_kernels import engram_gate as gating
from triton_kernels import runtime
from triton_kernels.engram_gate import engram_gate, engram_gate_ref, engram_gate_triton

EPS = 1e-6


def _inputs(s: int, n: int, d: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(s, n, d, generator=gen).to(dtype)
    kv = torch.randn(s, (n + 1) * d, generator=gen)
    q_weight, k_weight = (torch.rand(n, d, generator=gen) + 0.5 for _ in range(2))
    return x, kv, q_weight, k_weight


def _by_the_spec(x, kv, q_weight, k_weight, dead) -> torch.Tensor:
    """model-spec §6.4, one stream of one token at a time."""
    s, n, d = x.shape
    out = torch.empty(s, n, d)
    for t in range(s):
        key, val = kv[t, : n * d].view(n, d), kv[t, n * d :]
        for i in range(n):
            xi = x[t, i].float()
            dot = (xi * q_weight[i] * k_weight[i] * key[i]).sum()
            dot = dot * torch.rsqrt(xi.square().mean() + EPS) * torch.rsqrt(key[i].square().mean() + EPS)
            dot = float(dot) / math.sqrt(d)
            root = math.sqrt(max(abs(dot), 1e-6))
            z = root if dot > 0 else -root if dot < 0 else 0.0
            g = 0.0 if dead is not None and dead[t] else 1 / (1 + math.exp(-z))
            out[t, i] = xi + g * val
    return out.to(x.dtype)


@pytest.mark.parametrize("with_dead", [False, True], ids=["live", "dead"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("s", "n", "d"), [(3, 4, 32), (2, 2, 1100)])
def test_kernel_and_reference_follow_the_spec(
    s: int, n: int, d: int, dtype: torch.dtype, with_dead: bool
) -> None:
    """Rows longer than a tile (1100) are swept in sub-tiles, by every config; a dead position keeps x."""
    x, kv, q_weight, k_weight = _inputs(s, n, d, dtype)
    dead = torch.tensor([False, True, False][:s]) if with_dead else None
    expected = _by_the_spec(x, kv, q_weight, k_weight, dead)
    # bf16: one rounding of the output, where the interpreter truncates (devices round to nearest even).
    tol = {"rtol": 2**-7, "atol": 2**-6} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(engram_gate_ref(x, kv, q_weight, k_weight, EPS, dead), expected, **tol)
    for config in gating._CONFIGS:
        with gating._gate_tuned.forced(config):
            out = engram_gate_triton(x, kv, q_weight, k_weight, EPS, dead)
        torch.testing.assert_close(out, expected, **tol)
    if with_dead:
        assert torch.equal(out[1], x[1])


def test_public_op_dispatches(monkeypatch: pytest.MonkeyPatch) -> None:
    args = (*_inputs(4, 4, 16), EPS)
    expected = engram_gate_ref(*args)
    assert torch.equal(engram_gate(*args), expected)
    monkeypatch.setattr(runtime, "use_triton", lambda t: True)
    torch.testing.assert_close(engram_gate(*args), expected)
    assert engram_gate_triton(*_inputs(0, 4, 16), EPS).shape == (0, 4, 16)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"x": torch.zeros(2, 4)}, r"x: torch.float32 \(2, 4\) must be \[S, n, D\]"),
        ({"kv": torch.zeros(2, 64)}, r"kv: torch.float32 \(2, 64\) must be torch.float32 \(2, 80\)"),
        ({"q_weight": torch.zeros(4, 16, dtype=torch.bfloat16)}, r"q_weight: torch.bfloat16 \(4, 16\)"),
        (
            {"k_weight": torch.zeros(3, 16)},
            r"k_weight: torch.float32 \(3, 16\) must be torch.float32 \(4, 16\)",
        ),
        ({"dead": torch.zeros(2)}, r"dead: torch.float32 \(2,\) must be torch.bool \(2,\)"),
        ({"eps": 0.0}, "eps: 0.0 must be > 0"),
    ],
)
def test_validation(change: dict[str, object], match: str) -> None:
    x, kv, q_weight, k_weight = _inputs(2, 4, 16)
    args = {"x": x, "kv": kv, "q_weight": q_weight, "k_weight": k_weight, "eps": EPS, "dead": None}
    with pytest.raises(ValueError, match=match):
        engram_gate(**{**args, **change})
