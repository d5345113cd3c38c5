from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4HyperConnection,
    DeepseekV4HyperHead,
)

from triton_kernels import mhc, runtime
from triton_kernels.rmsnorm import rms_norm_ref

NORM_EPS, HC_EPS, ITERS = 1e-6, 1e-6, 20


@dataclass
class Params:
    fn: torch.Tensor
    base: torch.Tensor
    scale: torch.Tensor


def _params(rows: int, n: int, d: int, scales: int, seed: int, spread: float = 1.0) -> Params:
    gen = torch.Generator().manual_seed(seed)
    fn = torch.randn(rows, n * d, generator=gen) * spread / (n * d) ** 0.5
    base = torch.randn(rows, generator=gen) * spread
    return Params(fn, base, torch.rand(scales, generator=gen) * spread + 0.1)


def _streams(t: int, n: int, d: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(t, n, d, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _coeffs(fn, x: torch.Tensor, p: Params, iters: int = ITERS):
    return fn(x, p.fn, p.base, p.scale, norm_eps=NORM_EPS, hc_eps=HC_EPS, sinkhorn_iters=iters)


def _head(fn, x: torch.Tensor, p: Params):
    return fn(x, p.fn, p.base, p.scale, norm_eps=NORM_EPS, hc_eps=HC_EPS)


def _hf_config(n: int, d: int) -> DeepseekV4Config:
    return DeepseekV4Config(
        hidden_size=d,
        num_hidden_layers=1,
        hc_mult=n,
        hc_sinkhorn_iters=ITERS,
        hc_eps=HC_EPS,
        rms_norm_eps=NORM_EPS,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_transformers_hyper_connection(dtype: torch.dtype) -> None:
    n, d = 4, 32
    module = DeepseekV4HyperConnection(_hf_config(n, d))
    p = _params((2 + n) * n, n, d, 3, seed=1)
    for name in ("fn", "base", "scale"):
        getattr(module, name).data.copy_(getattr(p, name))
    x = _streams(6, n, d, dtype)
    post, comb, collapsed = module(x[None])
    pre_ref, post_ref, comb_ref = _coeffs(mhc.hc_coeffs_ref, x, p)
    torch.testing.assert_close(post_ref, post[0])
    torch.testing.assert_close(comb_ref, comb[0])
    torch.testing.assert_close(mhc.hc_collapse_ref(x, pre_ref), collapsed[0])
    # The decoder layer's residual update, in fp32: comb enters transposed.
    f = _streams(6, 1, d, seed=2)[:, 0]
    expected = post[0, :, :, None] * f[:, None, :] + torch.matmul(comb[0].transpose(-1, -2), x.float())
    torch.testing.assert_close(mhc.hc_update_ref(x.float(), f, post_ref, comb_ref), expected)


def test_reference_matches_transformers_hyper_head() -> None:
    n, d = 4, 32
    module = DeepseekV4HyperHead(_hf_config(n, d))
    p = _params(n, n, d, 1, seed=3)
    module.hc_fn.data.copy_(p.fn)
    module.hc_base.data.copy_(p.base)
    module.hc_scale.data.copy_(p.scale)
    x = _streams(5, n, d)
    pre = _head(mhc.hc_head_coeffs_ref, x, p)
    torch.testing.assert_close(mhc.hc_collapse_ref(x, pre), module(x[None])[0])


@settings(max_examples=25, deadline=None)
@given(t=st.integers(1, 8), n=st.integers(1, 6), spread=st.floats(0.05, 0.6), seed=st.integers(0, 2**16))
def test_reference_sinkhorn_invariants(t: int, n: int, spread: float, seed: int) -> None:
    # Logits of order one, as in the models: with logits spread over tens, 20 Sinkhorn steps leave
    # row sums off by ~1e-2 (in transformers too), and the 1e-3 row bound is not a property.
    d = 8
    x, p = _streams(t, n, d, seed=seed), _params((2 + n) * n, n, d, 3, seed, spread)
    pre, post, comb = _coeffs(mhc.hc_coeffs_ref, x, p)
    assert torch.all(comb > 0)
    torch.testing.assert_close(comb.sum(-2), torch.ones(t, n), rtol=0, atol=1e-5)
    torch.testing.assert_close(comb.sum(-1), torch.ones(t, n), rtol=0, atol=1e-3)
    # Closed bounds: fp32 sigmoid saturates to exactly 0 or 1 for large logits.
    assert torch.all((pre >= HC_EPS) & (pre <= 1 + HC_EPS))
    assert torch.all((post >= 0) & (post <= 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("t", "n", "d", "iters"),
    [
        (5, 4, 32, ITERS),
        (1, 4, 64, ITERS),
        (37, 4, 24, ITERS),
        (3, 3, 40, 7),
        (2, 1, 8, 1),
        (0, 4, 16, ITERS),
    ],
    ids=["toy", "single-token", "tokens-over-block", "odd-streams", "one-stream", "empty"],
)
def test_coeffs_kernel_matches_reference(t: int, n: int, d: int, iters: int, dtype: torch.dtype) -> None:
    x, p = _streams(t, n, d, dtype), _params((2 + n) * n, n, d, 3, seed=t)
    got = _coeffs(mhc.hc_coeffs_triton, x, p, iters)
    for out, ref in zip(got, _coeffs(mhc.hc_coeffs_ref, x, p, iters), strict=True):
        assert out.shape == ref.shape and out.dtype == torch.float32
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("config", mhc._MIX_CONFIGS, ids=lambda c: f"BLOCK_K={c.params['BLOCK_K']}")
def test_every_mix_config_matches_reference(config) -> None:  # noqa: ANN001
    # Tokens over a block and a K = n * d that is no multiple of BLOCK_K: ragged tiles in both directions.
    x, p = _streams(37, 4, 24), _params(24, 4, 24, 3, seed=37)
    head = _params(4, 4, 24, 1, seed=37)
    with mhc._hc_mix_tuned.forced(config):
        got, got_head = _coeffs(mhc.hc_coeffs_triton, x, p, ITERS), _head(mhc.hc_head_coeffs_triton, x, head)
    for out, ref in zip(got, _coeffs(mhc.hc_coeffs_ref, x, p, ITERS), strict=True):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_head, _head(mhc.hc_head_coeffs_ref, x, head))


@pytest.mark.parametrize(("t", "n", "d"), [(5, 4, 32), (19, 4, 40), (1, 2, 16), (0, 4, 16)])
def test_head_kernel_matches_reference(t: int, n: int, d: int) -> None:
    x, p = _streams(t, n, d), _params(n, n, d, 1, seed=t)
    torch.testing.assert_close(_head(mhc.hc_head_coeffs_triton, x, p), _head(mhc.hc_head_coeffs_ref, x, p))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "n", "d"), [(3, 4, 32), (1, 4, 600), (4, 3, 50), (0, 4, 8)])
def test_collapse_and_update_kernels_match_reference(t: int, n: int, d: int, dtype: torch.dtype) -> None:
    x, f = _streams(t, n, d, dtype), _streams(t, 1, d, dtype, seed=1)[:, 0]
    pre, post, comb = _coeffs(mhc.hc_coeffs_ref, x, _params((2 + n) * n, n, d, 3, seed=0))
    y = mhc.hc_collapse_triton(x, pre)
    assert y.shape == (t, d) and y.dtype == dtype
    torch.testing.assert_close(y, mhc.hc_collapse_ref(x, pre))
    out = mhc.hc_update_triton(x, f, post, comb)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, mhc.hc_update_ref(x, f, post, comb))


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "n", "d"), [(3, 4, 32), (2, 4, 1100), (1, 3, 50)])
def test_collapse_with_its_norm_is_the_norm_of_the_collapse(
    t: int, n: int, d: int, dtype: torch.dtype, weighted: bool
) -> None:
    """The fused norm reads the collapse rounded to the streams' dtype, as the sublayer's norm does; rows
    longer than a tile (1100) are swept in sub-tiles, by every config."""
    x = _streams(t, n, d, dtype)
    pre = _coeffs(mhc.hc_coeffs_ref, x, _params((2 + n) * n, n, d, 3, seed=0))[0]
    weight = torch.rand(d, generator=torch.Generator().manual_seed(d)) + 0.5 if weighted else None
    expected = rms_norm_ref(mhc.hc_collapse_ref(x, pre), weight, 1e-6)
    assert torch.equal(mhc.hc_collapse_ref(x, pre, weight, 1e-6), expected)
    for config in mhc._COLLAPSE_CONFIGS:
        with mhc._hc_collapse_tuned.forced(config):
            out = mhc.hc_collapse_triton(x, pre, weight, 1e-6)
        assert out.dtype == dtype
        # bf16: the interpreter truncates where devices round to nearest even, twice (collapse, norm).
        tol = {"rtol": 2**-6, "atol": 2**-6} if dtype == torch.bfloat16 else {}
        torch.testing.assert_close(out, expected, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("carried", [False, True], ids=["own-pre", "carry"])
@pytest.mark.parametrize(("t", "n", "d"), [(19, 4, 100), (3, 2, 48)])
def test_mix_with_the_sublayer_input_is_the_coefficients_then_the_normed_collapse(
    t: int, n: int, d: int, dtype: torch.dtype, carried: bool
) -> None:
    """One launch gives hc_coeffs and hc_collapse with the norm (by pre, or by a carried pre-mix), for a
    partial token block (19) and columns past a collapse tile (100), by every config."""
    x, p = _streams(t, n, d, dtype), _params((2 + n) * n, n, d, 3, seed=t)
    weight = torch.rand(d, generator=torch.Generator().manual_seed(d)) + 0.5
    carry = torch.rand(t, n, generator=torch.Generator().manual_seed(1)) if carried else None
    kwargs = {"norm_eps": NORM_EPS, "hc_eps": HC_EPS, "sinkhorn_iters": ITERS}
    pre, post, comb = mhc.hc_coeffs_ref(x, p.fn, p.base, p.scale, **kwargs)
    h = mhc.hc_collapse_ref(x, pre if carry is None else carry, weight, 1e-6)
    mix = {**kwargs, "input_weight": weight, "input_eps": 1e-6, "carry": carry}
    for out, ref in zip(mhc.hc_mix_ref(x, p.fn, p.base, p.scale, **mix), (pre, post, comb, h), strict=True):
        assert torch.equal(out, ref)
    tol = {"rtol": 2**-6, "atol": 2**-6} if dtype == torch.bfloat16 else {}
    for config in mhc._MIX_CONFIGS:
        with mhc._hc_mix_tuned.forced(config):
            got = mhc.hc_mix_triton(x, p.fn, p.base, p.scale, **mix)
        for out, ref in zip(got[:3], (pre, post, comb), strict=True):
            torch.testing.assert_close(out, ref)
        assert got[3].dtype == dtype
        torch.testing.assert_close(got[3], h, **tol)


def test_update_uses_comb_transposed() -> None:
    x = torch.zeros(1, 2, 1)
    x[0, 0, 0] = 1.0  # only stream 0 carries signal
    comb = torch.tensor([[[0.0, 1.0], [1.0, 0.0]]])  # comb[0, 1] = 1: stream 0 feeds output stream 1
    for update in (mhc.hc_update_ref, mhc.hc_update_triton):
        out = update(x, torch.zeros(1, 1), torch.zeros(1, 2), comb)
        assert out[0, :, 0].tolist() == [0.0, 1.0]


def test_public_ops_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    n, d = 4, 16
    x, p, f = _streams(3, n, d), _params((2 + n) * n, n, d, 3, seed=0), _streams(3, 1, d, seed=1)[:, 0]
    hp = _params(n, n, d, 1, seed=1)

    def run_all():
        pre, post, comb = _coeffs(mhc.hc_coeffs, x, p)
        head = _head(mhc.hc_head_coeffs, x, hp)
        return pre, post, comb, head, mhc.hc_collapse(x, pre), mhc.hc_update(x, f, post, comb)

    on_cpu = run_all()
    monkeypatch.setattr(runtime, "use_triton", lambda t: True)
    torch.testing.assert_close(run_all(), on_cpu, rtol=1e-5, atol=1e-6)


_X = torch.zeros(2, 4, 8)


def _mix_with(**override):
    good = {"x": _X, "fn": torch.zeros(24, 32), "base": torch.zeros(24), "scale": torch.ones(3)}
    coeffs = {"norm_eps": NORM_EPS, "hc_eps": HC_EPS, "sinkhorn_iters": ITERS}
    return mhc.hc_mix(**{**good, **coeffs, "input_weight": torch.ones(8), "input_eps": 1e-6, **override})


def _coeffs_with(**override):
    good = {"x": _X, "fn": torch.zeros(24, 32), "base": torch.zeros(24), "scale": torch.ones(3)}
    return mhc.hc_coeffs(
        **{**good, "norm_eps": NORM_EPS, "hc_eps": HC_EPS, "sinkhorn_iters": ITERS, **override}
    )


def _head_with(**override):
    good = {"x": _X, "fn": torch.zeros(4, 32), "base": torch.zeros(4), "scale": torch.ones(1)}
    return mhc.hc_head_coeffs(**{**good, "norm_eps": NORM_EPS, "hc_eps": HC_EPS, **override})


def _update_with(**override):
    good = {"x": _X, "f": torch.zeros(2, 8), "post": torch.ones(2, 4), "comb": torch.ones(2, 4, 4)}
    return mhc.hc_update(**{**good, **override})


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: _coeffs_with(x=torch.zeros(2, 32)), "x: shape"),
        (lambda: _coeffs_with(x=torch.zeros(2, 4, 8, dtype=torch.float16)), "x: dtype"),
        (lambda: _coeffs_with(x=torch.zeros(2, 17, 8)), "x: 17 streams exceeds the limit 16"),
        (
            lambda: _coeffs_with(fn=torch.zeros(24, 31)),
            r"fn: .*\(24, 31\).* must be torch.float32 \(24, 32\)",
        ),
        (lambda: _coeffs_with(base=torch.zeros(24, dtype=torch.bfloat16)), "base: torch.bfloat16"),
        (lambda: _coeffs_with(scale=torch.ones(1)), r"scale: .* must be torch.float32 \(3,\)"),
        (lambda: _coeffs_with(sinkhorn_iters=0), "sinkhorn_iters: 0 must be >= 1"),
        (lambda: _coeffs_with(norm_eps=0.0), "norm_eps: 0.0 must be > 0"),
        (lambda: _coeffs_with(hc_eps=-1.0), "hc_eps: -1.0 must be >= 0"),
        (lambda: _head_with(fn=torch.zeros(24, 32)), r"fn: .* must be torch.float32 \(4, 32\)"),
        (lambda: _head_with(scale=torch.ones(3)), r"scale: .* must be torch.float32 \(1,\)"),
        (lambda: mhc.hc_collapse(_X, torch.ones(3, 4)), r"pre: .* must be torch.float32 \(2, 4\)"),
        (lambda: _mix_with(carry=torch.ones(2, 3)), r"carry: .* must be torch.float32 \(2, 4\)"),
        (lambda: _mix_with(input_weight=torch.ones(7)), r"weight: shape \(7,\) must be \(8,\)"),
        (lambda: _mix_with(fn=torch.zeros(24, 31)), r"fn: .*\(24, 31\).* must be torch.float32 \(24, 32\)"),
        (lambda: mhc.hc_collapse(_X, torch.ones(2, 4), torch.ones(8)), "norm_weight: given without norm_eps"),
        (
            lambda: mhc.hc_collapse(_X, torch.ones(2, 4), torch.ones(7), 1e-6),
            r"weight: shape \(7,\) must be \(8,\)",
        ),
        (lambda: _update_with(f=torch.zeros(2, 8, dtype=torch.bfloat16)), "f: torch.bfloat16"),
        (lambda: _update_with(post=torch.ones(2, 4, device="meta")), "post: .* on meta"),
        (lambda: _update_with(comb=torch.ones(2, 4)), r"comb: .* must be torch.float32 \(2, 4, 4\)"),
    ],
)
def test_validation(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_empty_input_does_not_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("_hc_mix_tuned", "_hc_collapse_tuned", "_hc_update_tuned"):
        monkeypatch.setattr(mhc, name, None)  # any launch would fail
    x, p = _streams(0, 4, 8), _params(24, 4, 8, 3, seed=0)
    pre, post, comb = _coeffs(mhc.hc_coeffs_triton, x, p)
    assert pre.shape == post.shape == (0, 4) and comb.shape == (0, 4, 4)
    assert _head(mhc.hc_head_coeffs_triton, x, _params(4, 4, 8, 1, seed=0)).shape == (0, 4)
    assert mhc.hc_collapse_triton(x, pre).shape == (0, 8)
    assert mhc.hc_update_triton(x, torch.zeros(0, 8), post, comb).shape == (0, 4, 8)
