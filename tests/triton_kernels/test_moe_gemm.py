from __future__ import annotations

import dataclasses

import pytest
import torch

from model.quant import dequantize_fp4, dequantize_fp8
from tests.triton_kernels.packed import assert_close, random_weight
from triton_kernels import moe_gemm, runtime
from triton_kernels.moe_gemm import (
    ExpertRouting,
    RoutedExperts,
    combine_ref,
    combine_triton,
    moe_gemm_ref,
    moe_gemm_triton,
    sort_by_expert,
    sort_by_expert_triton,
    swiglu,
    swiglu_ref,
    swiglu_triton,
)
from triton_kernels.quant import dequantize_int8, quantize_int8_ref
from triton_kernels.quant_matmul import QuantWeight, dense_weight

E, D, INTER, K_CHOICES = 5, 64, 48, 2
FORMATS = ("mxfp4", "fp8-128", "fp8-32", "dense", "int8", "int4")
INTEGER = ("int8", "int4")


def _experts(fmt: str, limit: float | None = 0.5, d: int = D, inter: int = INTER) -> RoutedExperts:
    # Exponents around 2**-9: expert outputs of order one, so the SwiGLU clamp cuts only some values.
    def stack(n: int, k: int, seed: int) -> QuantWeight:
        return random_weight(fmt, n, k, seed=seed, experts=(E,), exponents=(114, 120))

    return RoutedExperts(stack(inter, d, 1), stack(inter, d, 2), stack(d, inter, 3), limit)


def _routing(t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts 3 and 4 get no token; some choices are dropped (-1) and one id is out of range."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 3, (t, K_CHOICES), generator=gen, dtype=torch.int32)
    ids[::3, 1] = -1
    if t > 4:
        ids[4, 0] = E
    return ids, torch.rand(t, K_CHOICES, generator=gen)


def _x(t: int, d: int = D, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(t, d, generator=torch.Generator().manual_seed(7)).to(dtype)


def _in_bf16(experts: RoutedExperts) -> RoutedExperts:
    """Dense stacks in bf16, as a bf16 model holds them."""
    w1, w3, w2 = (dense_weight(w.data.bfloat16()) for w in (experts.w1, experts.w3, experts.w2))
    return RoutedExperts(w1, w3, w2, experts.swiglu_limit)


def _dequantised(w: QuantWeight, e: int) -> torch.Tensor:
    if w.format == "dense":
        return w.data[e].float()
    if w.format == "int8":
        return w.data[e].float() * w.scale[e][:, None]
    if w.format == "int4":  # byte [j, k]: output 2j in the low nibble, 2j + 1 in the high one, signed
        b = w.data[e].to(torch.int32)
        codes = torch.stack([(b << 28) >> 28, (b << 24) >> 28], dim=1).reshape(-1, b.shape[1])
        return codes.float() * w.scale[e][:, None]
    data, scale = w.data[e], w.scale[e].view(torch.float8_e8m0fnu)
    if w.format == "mxfp4":
        return dequantize_fp4(data, scale, torch.float32)
    return dequantize_fp8(data.view(torch.float8_e4m3fn), scale, w.block, torch.float32)


def _dense_moe(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: RoutedExperts
) -> torch.Tensor:
    """Model-spec §7 token by token, over weights dequantised whole by the loader's functions; the integer
    formats see their activations rounded per token (the input, then the SwiGLU output)."""
    w1, w3, w2, limit = experts.w1, experts.w3, experts.w2, experts.swiglu_limit

    def rounded(v: torch.Tensor, fmt: str) -> torch.Tensor:
        return dequantize_int8(*quantize_int8_ref(v)) if fmt in INTEGER else v

    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        xt = rounded(x[t].float(), w1.format)
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < E:
                continue
            gate, up = _dequantised(w1, e) @ xt, _dequantised(w3, e) @ xt
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            h = rounded(torch.nn.functional.silu(gate) * up, w2.format)
            out[t] += weights[t, j] * (_dequantised(w2, e) @ h)
    return out


def test_sort_by_expert_groups_choices_stably() -> None:
    ids, weights = _routing(17)
    routing = sort_by_expert(ids, weights, E)
    flat = ids.reshape(-1)
    valid = (flat >= 0) & (flat < E)
    counts = torch.bincount(flat[valid].long(), minlength=E)
    assert routing.offsets.tolist() == [0, *torch.cumsum(counts, 0).tolist()] and counts[3:].eq(0).all()
    choice = torch.arange(flat.numel())
    assert torch.equal(routing.tokens[routing.inverse].long(), choice // K_CHOICES)
    assert torch.equal(routing.weights[routing.inverse], weights.reshape(-1))
    assert routing.inverse[~valid].ge(routing.offsets[-1]).all()  # dropped choices sort last
    for e in range(E):
        rows = routing.tokens[routing.offsets[e] : routing.offsets[e + 1]]
        assert torch.equal(rows.long(), (choice[flat == e] // K_CHOICES))  # tokens ascending


def _assert_same_routing(routing: ExpertRouting, expected: ExpertRouting) -> None:
    for field in dataclasses.fields(ExpertRouting):
        got, want = getattr(routing, field.name), getattr(expected, field.name)
        assert got.dtype == want.dtype and torch.equal(got, want), field.name


# Choices from one block to many (BLOCK 16 or 32), k = 1 .. 8, E not a power of two, E + 1 one (7), E = 1.
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("t", "k", "experts"), [(1, 1, 3), (3, 8, 5), (17, 6, 7), (40, 1, 1), (300, 3, 13)])
def test_routing_kernel_equals_sort_by_expert(t: int, k: int, experts: int, id_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(t * k)
    # Ids from -1 to E + 1: ties within and across blocks, dropped choices (-1 and >= E) among them.
    ids = torch.randint(-1, experts + 2, (t, k), generator=gen, dtype=id_dtype)
    weights = torch.rand(t, k, generator=gen)
    _assert_same_routing(sort_by_expert_triton(ids, weights, experts), sort_by_expert(ids, weights, experts))


@pytest.mark.parametrize("config", moe_gemm._ROUTE_CONFIGS, ids=lambda c: f"BLOCK={c.params['BLOCK']}")
def test_every_routing_config_equals_sort_by_expert(config) -> None:  # noqa: ANN001
    # 256 experts (V4-Flash's, the widest tile); int64 ids that an int32 cast would wrap into range.
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(-1, 258, (37, 6), generator=gen)
    ids[0, :3] = torch.tensor([2**32 + 5, -(2**32) + 7, 2**31])
    weights = torch.rand(37, 6, generator=gen)
    with moe_gemm._route_tuned.forced(config):
        routing = sort_by_expert_triton(ids, weights, 256)
    _assert_same_routing(routing, sort_by_expert(ids, weights, 256))


def test_routing_kernel_refuses_more_experts_than_its_tile() -> None:
    ids = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="num_experts: 512 exceeds the routing kernel's 511"):
        sort_by_expert_triton(ids, torch.rand(2, 2), 512)


@pytest.mark.parametrize("limit", [0.5, None])
@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_equals_dequantise_then_dense(fmt: str, limit: float | None) -> None:
    experts, (ids, weights), x = _experts(fmt, limit), _routing(9), _x(9)
    assert_close(moe_gemm_ref(x, ids, weights, experts), _dense_moe(x, ids, weights, experts))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 3, 17])
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_matches_reference(fmt: str, t: int, dtype: torch.dtype) -> None:
    experts, (ids, weights), x = _experts(fmt), _routing(t, seed=t), _x(t, dtype=dtype)
    if fmt == "dense" and dtype == torch.bfloat16:
        experts = _in_bf16(experts)
    out = moe_gemm_triton(x, ids, weights, experts)
    assert out.shape == (t, D) and out.dtype == dtype
    assert_close(out, moe_gemm_ref(x, ids, weights, experts))


@pytest.mark.parametrize("fmt", ["fp8-32", "dense", "int8", "int4"])
def test_kernel_ragged_against_every_tile_without_clamp(fmt: str) -> None:
    # D = 160 and I = 40: partial 128-wide K slices and scale blocks, partial 32-wide column tiles (and
    # for int4 partial tiles of 16 or 20 byte rows).
    experts, (ids, weights), x = (
        _experts(fmt, None, d=160, inter=40),
        _routing(17, seed=3),
        _x(17, d=160),
    )
    assert_close(moe_gemm_triton(x, ids, weights, experts), _dense_moe(x, ids, weights, experts))


def _tile(config) -> str:  # noqa: ANN001
    return "x".join(str(v) for v in config.params.values())


@pytest.mark.parametrize("config", moe_gemm._GATE_UP_CONFIGS, ids=_tile)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_gate_up_config_matches_the_reference(fmt: str, config) -> None:  # noqa: ANN001
    # The ragged shape of the test above: partial K slices and column tiles for every tile shape.
    experts, (ids, weights), x = _experts(fmt, d=160, inter=40), _routing(17, seed=3), _x(17, d=160)
    with moe_gemm._gate_up_tuned.forced(config):
        assert_close(moe_gemm_triton(x, ids, weights, experts), _dense_moe(x, ids, weights, experts))


def test_all_choices_dropped_give_zeros() -> None:
    ids = torch.full((3, K_CHOICES), -1, dtype=torch.int64)
    out = moe_gemm_triton(_x(3), ids, torch.rand(3, K_CHOICES), _experts("mxfp4"))
    assert torch.equal(out, torch.zeros(3, D))


def test_no_tokens_does_not_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(moe_gemm, "_gate_up_tuned", None)  # any launch would fail
    ids = torch.zeros(0, K_CHOICES, dtype=torch.int32)
    assert moe_gemm_triton(_x(0), ids, torch.zeros(0, K_CHOICES), _experts("mxfp4")).shape == (0, D)


def test_public_op_dispatches(monkeypatch: pytest.MonkeyPatch) -> None:
    experts, (ids, weights), x = _experts("fp8-32"), _routing(4), _x(4)
    expected = moe_gemm_ref(x, ids, weights, experts)
    assert torch.equal(moe_gemm.moe_gemm(x, ids, weights, experts), expected)
    monkeypatch.setattr(runtime, "use_triton", lambda t: True)
    assert_close(moe_gemm.moe_gemm(x, ids, weights, experts), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_shared", [False, True], ids=["routed", "shared"])
@pytest.mark.parametrize("k", [1, 2, 6])
def test_combine_sums_in_slot_order_then_adds_the_shared_expert(
    dtype: torch.dtype, with_shared: bool, k: int
) -> None:
    """The kernel's combine is the reference's: the routed sum rounded to x's dtype, then plus the shared
    output in fp32 (in fp32 bit for bit up to k = 2, where both sum in slot order); dropped rows read as 0."""
    gen = torch.Generator().manual_seed(k)
    t, d = 5, 1100  # a partial column tile for both configs
    y = torch.randn(t * k + 3, d, generator=gen)
    y[-3:] = 0.0  # the dropped choices' rows, past the last expert's: never written by the kernels
    inverse = torch.randperm(t * k + 3, generator=gen)[: t * k]
    shared = torch.randn(t, d, generator=gen).to(dtype) if with_shared else None
    expected = combine_ref(y, inverse, k, dtype, shared)
    y[-3:] = float("nan")
    for config in moe_gemm._COMBINE_CONFIGS:
        with moe_gemm._combine_tuned.forced(config):
            out = combine_triton(y, inverse, k, dtype, shared, torch.tensor([t * k], dtype=torch.int32))
        assert out.dtype == (torch.float32 if with_shared else dtype)
        if dtype == torch.float32 and k <= 2:
            assert torch.equal(out, expected)
        else:
            _assert_within_ulps(out, expected, dtype)


def _assert_within_ulps(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    # The interpreter truncates fp32 -> bf16 where devices round to nearest even: one bf16 ulp apart.
    ulp = 2**-7 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(out, expected, rtol=ulp, atol=ulp * float(expected.abs().max()))


def test_shared_expert_output_joins_the_combine(monkeypatch: pytest.MonkeyPatch) -> None:
    experts, (ids, weights), x = _experts("fp8-32"), _routing(4), _x(4, dtype=torch.bfloat16)
    shared = _x(4, dtype=torch.bfloat16).flip(0)
    routed = moe_gemm.moe_gemm(x, ids, weights, experts)
    expected = routed.float() + shared.float()
    assert torch.equal(moe_gemm.moe_gemm(x, ids, weights, experts, shared), expected)
    monkeypatch.setattr(runtime, "use_triton", lambda t: True)
    _assert_within_ulps(moe_gemm.moe_gemm(x, ids, weights, experts, shared), expected, torch.bfloat16)
    empty = torch.zeros(0, K_CHOICES, dtype=torch.int64)
    assert torch.equal(
        moe_gemm.moe_gemm(x[:0], empty, empty.float(), experts, shared[:0]), shared[:0].float()
    )
    with pytest.raises(
        ValueError, match=r"shared: torch.float32 \(4, 64\) on cpu must be x's torch.bfloat16"
    ):
        moe_gemm.moe_gemm(x, ids, weights, experts, shared.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_reads_the_column_ranges_of_one_projection(dtype: torch.dtype) -> None:
    """The shared expert's gate and up as the two halves of one GEMM's output: rows at its stride."""
    gate_up = (torch.randn(7, 2 * 1100, generator=torch.Generator().manual_seed(0)) * 2).to(dtype)
    gate, up = gate_up.split(1100, dim=-1)
    for config in moe_gemm._swiglu_tuned.configs:
        with moe_gemm._swiglu_tuned.forced(config):
            out = swiglu_triton(gate, up, 0.5)
        _assert_within_ulps(out, swiglu_ref(gate.contiguous(), up.contiguous(), 0.5), dtype)


def _stack(fmt: str, n: int, k: int, experts: int = E) -> QuantWeight:
    return random_weight(fmt, n, k, experts=(experts,))


@pytest.mark.parametrize(
    ("weights", "match"),
    [
        ({"w1": random_weight("int8", INTER, D)}, r"w1: 0 experts, expected a stack of w1's 0 \(>= 1\)"),
        ({"w3": _stack("int4", INTER, D)}, "w3: int4 .* must match w1: mxfp4"),
        ({"w3": _stack("fp8-32", INTER, D)}, "w3: fp8 .* must match w1: mxfp4"),
        ({"w2": _stack("mxfp4", D, INTER, E - 1)}, "w2: 4 experts, expected a stack of w1's 5"),
        ({"w2": _stack("mxfp4", INTER, D)}, r"w2: \[48, 64\] each, expected \[64, 48\]"),
        ({"swiglu_limit": 0.0}, "swiglu_limit: 0.0 must be > 0 or None"),
    ],
)
def test_expert_validation(weights: dict[str, object], match: str) -> None:
    base = _experts("mxfp4")
    args = {"w1": base.w1, "w3": base.w3, "w2": base.w2, "swiglu_limit": 0.5}
    with pytest.raises(ValueError, match=match):
        RoutedExperts(**{**args, **weights})


@pytest.mark.parametrize(
    ("call", "match"),
    [
        ({"x": torch.zeros(4, D + 2)}, r"x: shape \(4, 66\) must be \[M, 64\]"),
        ({"topk_ids": torch.zeros(4, 2)}, "topk_ids: torch.float32"),
        ({"topk_weights": torch.zeros(4, 3)}, r"topk_weights: torch.float32 \(4, 3\) must be fp32 \(4, 2\)"),
    ],
)
def test_call_validation(call: dict[str, object], match: str) -> None:
    ids, weights = _routing(4)
    args = {"x": _x(4), "topk_ids": ids, "topk_weights": weights, "experts": _experts("mxfp4")}
    with pytest.raises(ValueError, match=match):
        moe_gemm.moe_gemm(**{**args, **call})


@pytest.mark.parametrize(
    ("dtype", "limit"), [(torch.float32, 0.5), (torch.bfloat16, 0.5), (torch.float32, None)]
)
def test_swiglu_kernel_matches_reference(dtype: torch.dtype, limit: float | None) -> None:
    """The shared expert's SwiGLU: fp32 maths, one rounding to the projections' dtype; 1500 values span
    several tiles and a partial one."""
    gen = torch.Generator().manual_seed(4)
    gate, up = (torch.randn(5, 300, generator=gen).to(dtype) for _ in range(2))
    got, want = swiglu_triton(gate, up, limit), swiglu_ref(gate, up, limit)
    assert got.dtype == dtype
    if limit is not None:
        assert want.float().abs().max() <= limit * limit  # the clamps cut some values
    torch.testing.assert_close(
        got.float(), want.float(), rtol=2e-6 if dtype == torch.float32 else 2**-7, atol=0
    )


def test_swiglu_validates() -> None:
    gate = torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"gate / up: torch.float32 \(2, 4\) and torch.bfloat16 \(2, 4\)"):
        swiglu(gate, gate.bfloat16(), 1.0)
    with pytest.raises(ValueError, match=r"and torch.float32 \(2, 3\) must be of one shape"):
        swiglu(gate, gate[:, :3], 1.0)
