"""The MoE router: the kernel against the reference (the model's routing maths), every released router
shape, hash layers, ties, the softplus regimes; the contract's validation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from triton_kernels import runtime
from triton_kernels.router import route, route_ref, route_triton


def _logits(s: int, e: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(s, e, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize(
    ("s", "e", "k", "normalize", "scaling", "temp"),
    [
        (5, 8, 2, True, 1.0, 1.0),  # tiny V4
        (9, 256, 6, True, 1.5, 1.0),  # V4-Flash, rows past a tile
        (3, 384, 6, True, 2.5, 1.0),  # V4.1
        (4, 128, 3, False, 1.0, 0.7),  # V4.1 draft, not normalised, a gate temperature
        (1, 6, 6, True, 1.0, 1.0),  # every expert taken
    ],
)
def test_score_routing_matches_the_reference(
    s: int, e: int, k: int, normalize: bool, scaling: float, temp: float
) -> None:
    logits, bias = _logits(s, e), torch.randn(e, generator=torch.Generator().manual_seed(1))
    picked, weights = route_triton(logits, bias, None, k, temp, normalize, scaling)
    want_picked, want_weights = route_ref(logits, bias, None, k, temp, normalize, scaling)
    assert picked.dtype == torch.int64 and torch.equal(picked, want_picked)
    torch.testing.assert_close(weights, want_weights, rtol=2e-6, atol=0)


def test_hash_routing_weights_the_given_experts() -> None:
    logits = _logits(7, 16)
    hashed = torch.randint(0, 16, (7, 4), generator=torch.Generator().manual_seed(2))
    picked, weights = route_triton(logits, None, hashed, 4, 1.0, True, 1.5)
    want_picked, want_weights = route_ref(logits, None, hashed, 4, 1.0, True, 1.5)
    assert torch.equal(picked, want_picked)
    torch.testing.assert_close(weights, want_weights, rtol=2e-6, atol=0)


def test_ties_go_to_the_lower_expert_largest_first() -> None:
    logits = torch.tensor([[0.5, 2.0, 0.5, 2.0, -1.0, 0.5]])
    picked, _ = route_triton(logits, torch.zeros(6), None, 4, 1.0, True, 1.0)
    assert picked.tolist() == [[1, 3, 0, 2]]


def test_softplus_follows_torch_in_every_regime() -> None:
    """Above the threshold x itself; far below it, where 1 + exp(x) rounds to 1, log1p's accuracy."""
    x = torch.tensor([[-90.0, -40.0, -17.0, -1e-3, 0.0, 3.0, 19.9, 20.0, 20.5, 60.0]])
    _, weights = route_triton(x, None, torch.arange(10)[None], 10, 1.0, False, 1.0)
    torch.testing.assert_close(weights, torch.sqrt(F.softplus(x)), rtol=2e-6, atol=0)


def test_no_rows() -> None:
    picked, weights = route_triton(torch.zeros(0, 8), torch.zeros(8), None, 2, 1.0, True, 1.0)
    assert picked.shape == weights.shape == (0, 2)


def test_public_op_dispatches_and_validates(monkeypatch: pytest.MonkeyPatch) -> None:
    logits, bias = _logits(3, 8), torch.zeros(8)
    assert torch.equal(
        route(logits, bias, None, 2, 1.0, True, 1.0)[0], route_ref(logits, bias, None, 2, 1.0, True, 1.0)[0]
    )
    with pytest.raises(ValueError, match=r"k: 9 must lie in \[1, 8\] \(experts 8\)"):
        route(logits, bias, None, 9, 1.0, True, 1.0)
    with pytest.raises(ValueError, match="exactly one must be given"):
        route(logits, bias, torch.zeros(3, 2, dtype=torch.int64), 2, 1.0, True, 1.0)
    with pytest.raises(ValueError, match=r"logits: torch.bfloat16 \(3, 8\) must be float32"):
        route(logits.bfloat16(), bias, None, 2, 1.0, True, 1.0)
    with pytest.raises(ValueError, match=r"logits: torch.float32 \(3, 513\) must be float32 \[S, E <= 512\]"):
        route(torch.zeros(3, 513), torch.zeros(513), None, 2, 1.0, True, 1.0)
    with pytest.raises(ValueError, match=r"hashed: torch.int64 \(3, 3\) must be int64 \(3, 2\)"):
        route(logits, None, torch.zeros(3, 3, dtype=torch.int64), 2, 1.0, True, 1.0)
    with pytest.raises(ValueError, match="temp: 0.0 must be > 0"):
        route(logits, bias, None, 2, 0.0, True, 1.0)
    monkeypatch.setattr(runtime, "use_triton", lambda t: True)
    launched = []
    monkeypatch.setattr("triton_kernels.router.route_triton", lambda *a: launched.append(a))
    route(logits, bias, None, 2, 1.0, True, 1.0)
    assert launched
