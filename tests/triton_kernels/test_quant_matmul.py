from __future__ import annotations

import pytest
import torch

from model.quant import dequantize_fp4, dequantize_fp8
from tests.triton_kernels.packed import assert_close, random_weight
from triton_kernels import moe_gemm, quant_matmul, runtime
from triton_kernels.quant import dequantize_int8, quantize_int8_ref
from triton_kernels.quant_matmul import (
    FP8_BLOCKS,
    QuantWeight,
    decode_e2m1,
    decode_e4m3,
    decode_e8m0,
    fp8_weight,
    int8_weight,
    mxfp4_weight,
    quant_matmul_ref,
    quant_matmul_triton,
)

_BYTES = torch.arange(256, dtype=torch.uint8)
_E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # model-spec §9.1, the magnitudes of codes 0..7
FORMATS = ("fp8-128", "fp8-32", "mxfp4", "int8")
_U8 = torch.uint8


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().view(torch.int32)  # compares -0.0 apart from 0.0


def _x(m: int, k: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_e4m3_decode_is_torchs_float8_bit_for_bit() -> None:
    expected = _BYTES.view(torch.float8_e4m3fn).float()
    got = decode_e4m3(_BYTES)
    nan = expected.isnan()
    assert nan.sum() == 2 and torch.equal(got.isnan(), nan)
    assert torch.equal(_bits(got)[~nan], _bits(expected)[~nan])


def test_e8m0_decode_is_torchs_float8_bit_for_bit() -> None:
    expected = _BYTES.view(torch.float8_e8m0fnu).float()
    got = decode_e8m0(_BYTES)
    assert torch.equal(_bits(got[:255]), _bits(expected[:255])) and got[255].isnan() and expected[255].isnan()


def test_e2m1_decode_matches_the_table() -> None:
    table = torch.tensor(_E2M1_TABLE + [-v for v in _E2M1_TABLE])
    assert torch.equal(_bits(decode_e2m1(torch.arange(16))), _bits(table))


def test_kernel_decodes_every_fp8_byte() -> None:
    # y = I @ W^T = W^T: each weight row comes back as a column, NaN bytes poisoning theirs. The dot's
    # sums (-0.0 + 0.0) lose the sign of a zero, so the kernel's values are compared, not their bits.
    weight = fp8_weight(_BYTES.view(16, 16), torch.full((1, 1), 127, dtype=torch.uint8), 32)
    y = quant_matmul_triton(torch.eye(16), weight).T
    expected = _BYTES.view(torch.float8_e4m3fn).float().view(16, 16)
    poisoned = expected.isnan().any(dim=1)  # rows 7 (0x7F) and 15 (0xFF)
    assert poisoned.tolist() == [i in (7, 15) for i in range(16)] and y[poisoned].isnan().all()
    assert torch.equal(y[~poisoned], expected[~poisoned])


def test_kernel_decodes_every_e2m1_code_and_e8m0_exponent() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).repeat(2)[None]  # one row of 32 inputs: codes 0..15 twice
    weight = mxfp4_weight(packed, torch.full((1, 1), 127, dtype=torch.uint8))
    expected = torch.tensor(_E2M1_TABLE + [-v for v in _E2M1_TABLE]).repeat(2)
    assert torch.equal(quant_matmul_triton(torch.eye(32), weight)[:, 0], expected)
    # Input 0 weighs 1.0 (code 2), the others 0, and row n is scaled by exponent byte n: y[n] = 2**(n - 127).
    first = torch.zeros(256, 16, dtype=torch.uint8)
    first[:, 0] = 2
    y = quant_matmul_triton(torch.ones(1, 32), mxfp4_weight(first, _BYTES[:, None]))[0]
    assert torch.equal(y[:255], _BYTES[:255].view(torch.float8_e8m0fnu).float())
    assert y[255].isnan()


def test_int4_codes_are_signed_nibbles_along_the_output() -> None:
    # Byte 0x97 holds output 0 in its low nibble (7) and output 1 in its high one (0x9: -7).
    data = torch.tensor([[0x97 - 256, 0x0F]], dtype=torch.int8)  # input 1: 0x0F -> -1 (low), 0 (high)
    weight = quant_matmul.int4_weight(data, torch.tensor([0.5, 0.25]))
    assert weight.out_features == 2
    assert quant_matmul.integer_rows(weight, 0, 2).tolist() == [[7, -1], [-7, 0]]
    x = torch.tensor([[1.0, 0.0]])  # quantises exactly: 127 * (1 / 127)
    torch.testing.assert_close(quant_matmul_ref(x, weight), torch.tensor([[3.5, -1.75]]))


def _dense(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    """Dequantise the whole weight with the loader's functions, then one dense GEMM."""
    if weight.format == "fp8":
        w = dequantize_fp8(
            weight.data.view(torch.float8_e4m3fn),
            weight.scale.view(torch.float8_e8m0fnu),
            weight.block,
            torch.float32,
        )
    elif weight.format == "mxfp4":
        w = dequantize_fp4(weight.data, weight.scale.view(torch.float8_e8m0fnu), torch.float32)
    else:
        xq, xs = quantize_int8_ref(x)
        return dequantize_int8(xq, xs) @ (weight.data.float() * weight.scale[:, None]).T
    return x.float() @ w.T


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("n", "k"), [(70, 200), (130, 96), (1, 32)])
def test_reference_equals_dequantise_then_dense(fmt: str, n: int, k: int) -> None:
    weight, x = random_weight(fmt, n, k), _x(9, k)
    assert_close(quant_matmul_ref(x, weight), _dense(x, weight))


@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_decodes_one_tile_at_a_time(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    weight, x = random_weight(fmt, 300, 64), _x(2, 64)
    tiles: list[int] = []
    decode = quant_matmul.dequantize_rows
    monkeypatch.setattr(
        quant_matmul, "dequantize_rows", lambda w, a, b: tiles.append(b - a) or decode(w, a, b)
    )
    out = quant_matmul_ref(x, weight)
    if fmt != "int8":  # the int8 reference multiplies int8 rows directly
        assert sum(tiles) == 300 and max(tiles) == (weight.block if fmt.startswith("fp8") else 128)
    assert_close(out, _dense(x, weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_matches_reference(fmt: str, m: int, dtype: torch.dtype) -> None:
    n, k = (70, 200) if fmt != "fp8-128" else (130, 300)  # ragged against every tile and scale block
    weight, x = random_weight(fmt, n, k, seed=m), _x(m, k, dtype, seed=m)
    out = quant_matmul_triton(x, weight)
    assert out.shape == (m, n) and out.dtype == dtype
    assert_close(out, quant_matmul_ref(x, weight))


def test_mxfp4_inputs_not_a_multiple_of_the_group() -> None:
    weight, x = random_weight("mxfp4", 20, 80), _x(5, 80)  # 80 = 2.5 groups of 32
    assert_close(quant_matmul_triton(x, weight), _dense(x, weight))


_PACKED = [
    (tuned, variant.constexprs["SCALE_BLOCK"])
    for m in (quant_matmul, moe_gemm)
    for tuned in m.KERNELS
    for variant in tuned.variants
    if "SCALE_BLOCK" in variant.constexprs
]


@pytest.mark.parametrize(("tuned", "block"), _PACKED, ids=lambda x: getattr(x, "name", str(x)))
def test_packed_configs_tile_the_scale_groups(tuned, block: int) -> None:  # noqa: ANN001
    """What packed_matmul_tile assumes: a tile's rows share one FP8 exponent row, and a K slice holds
    whole scale groups (or lies inside one)."""
    for config in tuned.configs:
        bn, bk = config.params["BLOCK_N"], config.params["BLOCK_K"]
        assert all(b % bn == 0 for b in FP8_BLOCKS) and bk % 32 == 0 and (bk % block == 0 or block % bk == 0)


def test_public_op_dispatches(monkeypatch: pytest.MonkeyPatch) -> None:
    weight, x = random_weight("fp8-32", 40, 64), _x(3, 64)
    assert torch.equal(quant_matmul.quant_matmul(x, weight), quant_matmul_ref(x, weight))
    monkeypatch.setattr(runtime, "use_triton", lambda t: True)
    assert_close(quant_matmul.quant_matmul(x, weight), quant_matmul_ref(x, weight))


def test_empty_input_does_not_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quant_matmul, "_packed_tuned", None)  # any launch would fail
    assert quant_matmul_triton(torch.zeros(0, 32), random_weight("mxfp4", 8, 32)).shape == (0, 8)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: fp8_weight(torch.zeros(4, 64, dtype=_U8), torch.zeros(1, 1, dtype=_U8), 64), "block: 64"),
        (
            lambda: fp8_weight(torch.zeros(40, 64, dtype=_U8), torch.zeros(1, 2, dtype=_U8), 32),
            r"fp8 scale: shape \(1, 2\) must end in \(2, 2\)",
        ),
        (
            lambda: fp8_weight(torch.zeros(4, 64), torch.zeros(1, 2, dtype=_U8), 32),
            "fp8 data: dtype torch.float32",
        ),
        (
            lambda: mxfp4_weight(torch.zeros(4, 16, dtype=_U8), torch.zeros(4, 2, dtype=_U8)),
            r"mxfp4 scale: shape \(4, 2\) must end in \(4, 1\)",
        ),
        (
            lambda: mxfp4_weight(torch.zeros(2, 4, 16, dtype=_U8), torch.zeros(3, 4, 1, dtype=_U8)),
            "does not stack like data",
        ),
        (
            lambda: int8_weight(torch.zeros(4, 8, dtype=torch.int8), torch.zeros(5)),
            r"int8 scale: .* \[4\] or \[4, 1\]",
        ),
        (
            lambda: quant_matmul.int4_weight(torch.zeros(4, 8, dtype=torch.int8), torch.zeros(4)),
            r"int4 scale: .* \[8\] or \[8, 1\]",  # two outputs per byte row
        ),
        (lambda: quant_matmul.dense_weight(torch.zeros(4, 8, dtype=torch.int8)), "dense data: torch.int8"),
    ],
)
def test_weight_validation(build, match: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize(
    ("x", "weight", "match"),
    [
        (torch.zeros(2, 33), random_weight("fp8-32", 8, 32), r"x: shape \(2, 33\) must be \[M, 32\]"),
        (torch.zeros(2, 32, dtype=torch.float16), random_weight("int8", 8, 32), "x: dtype torch.float16"),
        (
            torch.zeros(2, 32),
            mxfp4_weight(torch.zeros(2, 8, 16, dtype=_U8), torch.zeros(2, 8, 1, dtype=_U8)),
            "stack of experts",
        ),
        (torch.zeros(2, 32), random_weight("int4", 8, 32), "format 'int4' is for routed experts"),
    ],
)
def test_call_validation(x: torch.Tensor, weight: QuantWeight, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        quant_matmul.quant_matmul(x, weight)
