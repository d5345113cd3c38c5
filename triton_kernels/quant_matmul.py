"""Weight-quantised GEMM ``y = x @ dequant(W)^T`` over the packed formats of the checkpoints (model-spec §9).

Contract
    ``quant_matmul(x [M, K] fp32 | bf16, weight: QuantWeight) -> [M, N]``, dtype of ``x``, fp32 maths.
    The weight stays in its stored bytes; build it with one of:

    - ``fp8_weight(data [N, K] uint8 | float8_e4m3fn, scale [ceil(N/B), ceil(K/B)] uint8 | float8_e8m0fnu,
      block B in {32, 128})``: E4M3 codes, one E8M0 exponent per ``B x B`` tile; ``w = q * 2**(e - 127)``.
    - ``mxfp4_weight(data [N, K/2] uint8 | int8, scale [N, ceil(K/32)] uint8 | float8_e8m0fnu)``: two
      E2M1 codes per byte, the low nibble the lower-indexed element, one E8M0 exponent per 32 inputs.
    - ``int8_weight(data [N, K] int8, scale [N] | [N, 1] fp32)`` (W8A8, msModelSlim ``W8A8_DYNAMIC``):
      ``w = q * scale[n]``. ``x`` is quantised per token at run time (``quant.quantize_int8_ref``:
      symmetric, ``amax / 127``) and ``y = (x_q @ W_q^T) * s_x[m] * s_w[n]``, int32 accumulation.
    - ``int4_weight(data [N/2, K] int8, scale [N] | [N, 1] fp32)`` (W4A8, msModelSlim ``W4A8_DYNAMIC``
      routed experts): two's-complement int4 codes packed along the output dimension, byte ``[j, k]``
      holding output ``2j`` in its low nibble and ``2j + 1`` in its high one; maths as int8.
    - ``dense_weight(data [N, K] fp32 | bf16)``: the weight itself (a routed-expert stack of a dense
      checkpoint), no scale.

    Each factory only views the bytes (no copy). An E8M0 byte 255 decodes to NaN, 0 to ``2**-127``;
    E4M3 ``0x7F`` / ``0xFF`` are NaN. Scale values are not range-checked (that would read the device).
    Leading dimensions (``data [E, N, ...]``, ``scale [E, ...]``) stack the routed experts for
    ``moe_gemm``; ``weight.expert(e)`` is one of them. ``quant_matmul`` takes a 2-D FP8, MXFP4 or int8
    weight (int4 and dense stacks exist for the routed experts only).

Reference
    ``quant_matmul_ref`` decodes one tile of rows at a time (``B`` rows for FP8, 128 otherwise) with the
    same integer and bit operations as the kernel, so the weight stays packed on the CPU too.

Kernels
    ``_packed_matmul_kernel`` (FP8 and MXFP4): one task is a ``BLOCK_M x BLOCK_N`` output tile; for each
    ``BLOCK_K`` slice it loads the weight bytes and their exponents, decodes them with integer ops and a
    bitcast to fp32 (no FP8 type: A2/A3 have none), scales them per group through a reshape (no
    gather) and calls ``tl.dot`` in fp32. MXFP4 splits ``x`` into its even and odd inputs, one dot per
    nibble, so the codes never need interleaving. ``_int8_matmul_kernel``: int8 x int8 -> int32 dots
    (``int_matmul_tile``, which ``moe_gemm`` shares and which also decodes int4 nibbles with two
    shifts), rescaled once per tile. ``packed_matmul_tile`` also takes dense fp32 / bf16 weights
    (``FORMAT`` 2) for ``moe_gemm``. Loads and stores are affine tiles with range masks: triton-ascend lowers
    them to rectangular sub-views (checked in the lowered IR: no element-wise fallback, no lane read
    outside the tensor). Clamping those offsets instead would turn every load into a scalar loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from triton_kernels import runtime, tuning
from triton_kernels.quant import quantize_int8_ref
from triton_kernels.spec import TuneConfig, Variant

FP8, MXFP4, INT8, INT4, DENSE = "fp8", "mxfp4", "int8", "int4", "dense"
FP8_BLOCKS = (32, 128)
MXFP4_GROUP = 32
FORMAT_IDS = {FP8: 0, MXFP4: 1, DENSE: 2, INT8: 3, INT4: 4}  # the kernels' FORMAT constexpr
INTEGER_FORMATS = (INT8, INT4)  # int8 activations, int32 accumulation
_MATMUL_FORMATS = (FP8, MXFP4, INT8)
_X_DTYPES = (torch.float32, torch.bfloat16)
_MAX_INT32 = 2**31 - 1  # offsets are int32 inside the kernels (the expert index is int64)
_REF_ROWS = 128


@dataclass(frozen=True)
class QuantWeight:
    """Packed weight ``[..., N, K]``; see the module contract for ``data`` and ``scale`` per format."""

    format: str
    data: torch.Tensor
    scale: torch.Tensor
    block: int  # FP8: B; MXFP4: 32; int8 / int4: 1 (per output channel); dense: 1
    in_features: int

    @property
    def out_features(self) -> int:
        return self.data.shape[-2] * (2 if self.format == INT4 else 1)

    @property
    def num_experts(self) -> int:
        return self.data.shape[0] if self.data.dim() == 3 else 0

    def expert(self, e: int) -> QuantWeight:
        return QuantWeight(self.format, self.data[e], self.scale[e], self.block, self.in_features)


def _leading(name: str, data: torch.Tensor, scale: torch.Tensor) -> None:
    if data.dim() not in (2, 3):
        raise ValueError(f"{name}: data shape {tuple(data.shape)} must be [N, K'] or [E, N, K']")
    if scale.dim() != data.dim() or scale.shape[:-2] != data.shape[:-2]:
        raise ValueError(
            f"{name}: scale shape {tuple(scale.shape)} does not stack like data {tuple(data.shape)}"
        )
    if scale.device != data.device:
        raise ValueError(f"{name}: scale device {scale.device} differs from data's {data.device}")


def _bytes(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {t.dtype} not supported, expected one of {dtypes}")
    return t.contiguous().view(torch.uint8)


def fp8_weight(data: torch.Tensor, scale: torch.Tensor, block: int) -> QuantWeight:
    if block not in FP8_BLOCKS:
        raise ValueError(f"block: {block} not supported, expected one of {FP8_BLOCKS}")
    _leading("fp8", data, scale)
    n, k = data.shape[-2:]
    expected = (-(-n // block), -(-k // block))
    if tuple(scale.shape[-2:]) != expected:
        raise ValueError(
            f"fp8 scale: shape {tuple(scale.shape)} must end in {expected} (N={n}, K={k}, B={block})"
        )
    data = _bytes("fp8 data", data, (torch.uint8, torch.float8_e4m3fn))
    return QuantWeight(FP8, data, _bytes("fp8 scale", scale, (torch.uint8, torch.float8_e8m0fnu)), block, k)


def mxfp4_weight(data: torch.Tensor, scale: torch.Tensor) -> QuantWeight:
    _leading("mxfp4", data, scale)
    n, k = data.shape[-2], 2 * data.shape[-1]
    expected = (n, -(-k // MXFP4_GROUP))
    if tuple(scale.shape[-2:]) != expected:
        raise ValueError(f"mxfp4 scale: shape {tuple(scale.shape)} must end in {expected} (N={n}, K={k})")
    data = _bytes("mxfp4 data", data, (torch.uint8, torch.int8))
    return QuantWeight(
        MXFP4, data, _bytes("mxfp4 scale", scale, (torch.uint8, torch.float8_e8m0fnu)), MXFP4_GROUP, k
    )


def _channel_weight(fmt: str, data: torch.Tensor, scale: torch.Tensor, rows_per_byte: int) -> QuantWeight:
    if data.dtype != torch.int8 or data.dim() not in (2, 3):
        raise ValueError(
            f"{fmt} data: {data.dtype} {tuple(data.shape)} must be a 2-D or 3-D torch.int8 tensor"
        )
    lead, n = tuple(data.shape[:-2]), data.shape[-2] * rows_per_byte
    if (
        scale.dtype != torch.float32
        or scale.numel() != math.prod(lead) * n
        or tuple(scale.shape[: len(lead) + 1]) != (*lead, n)
    ):
        raise ValueError(
            f"{fmt} scale: {scale.dtype} {tuple(scale.shape)} must be {[*lead, n]} or {[*lead, n, 1]} fp32"
        )
    if scale.device != data.device:
        raise ValueError(f"{fmt} scale: device {scale.device} differs from data's {data.device}")
    return QuantWeight(fmt, data.contiguous(), scale.reshape(*lead, n).contiguous(), 1, data.shape[-1])


def int8_weight(data: torch.Tensor, scale: torch.Tensor) -> QuantWeight:
    return _channel_weight(INT8, data, scale, 1)


def int4_weight(data: torch.Tensor, scale: torch.Tensor) -> QuantWeight:
    return _channel_weight(INT4, data, scale, 2)


def dense_weight(data: torch.Tensor) -> QuantWeight:
    if data.dtype not in _X_DTYPES or data.dim() not in (2, 3):
        raise ValueError(f"dense data: {data.dtype} {tuple(data.shape)} must be 2-D or 3-D of {_X_DTYPES}")
    empty = torch.empty((*data.shape[:-2], 0), device=data.device)  # no scale; stacks like data
    return QuantWeight(DENSE, data.contiguous(), empty, 1, data.shape[-1])


def check_activations(name: str, x: torch.Tensor, weight: QuantWeight) -> None:
    if x.dtype not in _X_DTYPES:
        raise ValueError(f"{name}: dtype {x.dtype} not supported, expected one of {_X_DTYPES}")
    if x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(f"{name}: shape {tuple(x.shape)} must be [M, {weight.in_features}] (the weight's K)")
    if x.device != weight.data.device:
        raise ValueError(f"{name}: device {x.device} differs from the weight's {weight.data.device}")
    n, k = weight.out_features, weight.in_features
    if n < 1 or k < 1:
        raise ValueError(f"weight: N={n}, K={k} must both be >= 1")
    if max(x.shape[0], n) * max(k, n) > _MAX_INT32:
        raise ValueError(f"{name}: M={x.shape[0]}, N={n}, K={k}: a 2-D extent exceeds {_MAX_INT32} elements")


def quant_matmul(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    if weight.format not in _MATMUL_FORMATS:
        raise ValueError(
            f"weight: format {weight.format!r} is for routed experts (moe_gemm), not {_MATMUL_FORMATS}"
        )
    if weight.data.dim() != 2:
        raise ValueError(f"weight: data shape {tuple(weight.data.shape)} is a stack of experts, expected 2-D")
    check_activations("x", x, weight)
    if runtime.use_triton(x):
        return quant_matmul_triton(x, weight)
    return quant_matmul_ref(x, weight)


# Reference: the same decode as the kernels, in torch integer ops.


def decode_e8m0(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent bytes -> fp32 ``2**(e - 127)`` (0 is the subnormal ``2**-127``, 255 NaN)."""
    e = e.to(torch.int32)
    bits = torch.where(e == 0, 0x00400000, e << 23)
    return torch.where(e == 255, 0x7FC00000, bits).view(torch.float32)


def decode_e4m3(b: torch.Tensor) -> torch.Tensor:
    """E4M3 (``fn``: no infinities) bytes -> fp32."""
    b = b.to(torch.int32)
    exp, man = (b >> 3) & 15, b & 7
    normal = (((b & 128) << 24) | ((exp + 120) << 23) | (man << 20)).view(torch.float32)
    sub = man.float() * 2.0**-9
    sub = torch.where(b >= 128, -sub, sub)
    return torch.where((b & 127) == 127, torch.nan, torch.where(exp == 0, sub, normal))


def decode_e2m1(c: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (0..15) -> fp32: sign ``c >> 3``, magnitude ``{0, .5, 1, 1.5, 2, 3, 4, 6}[c & 7]``."""
    c = c.to(torch.int32)
    exp, man = (c >> 1) & 3, c & 1
    bits = torch.where(exp == 0, man * (126 << 23), ((exp + 126) << 23) | (man << 22))
    return (bits | ((c & 8) << 28)).view(torch.float32)


def integer_rows(weight: QuantWeight, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of a 2-D int8 or int4 weight as int8 codes (``start`` even for int4)."""
    if weight.format == INT8:
        return weight.data[start:stop]
    b = weight.data[start // 2 : -(-stop // 2)]
    codes = torch.stack([(b << 4) >> 4, b >> 4], dim=1)  # arithmetic shifts: signed nibbles
    return codes.view(-1, weight.in_features)[start % 2 : start % 2 + stop - start]


def dequantize_rows(weight: QuantWeight, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of a 2-D weight in fp32 (``start`` a multiple of the FP8 block)."""
    k, rows = weight.in_features, weight.data[start:stop]
    if weight.format == FP8:
        b = weight.block
        scale = decode_e8m0(weight.scale[start // b : -(-stop // b)]).repeat_interleave(b, 0)
        return decode_e4m3(rows) * scale.repeat_interleave(b, 1)[: stop - start, :k]
    if weight.format == MXFP4:
        codes = torch.stack([rows & 15, rows >> 4], dim=-1).view(stop - start, k)
        scale = decode_e8m0(weight.scale[start:stop]).repeat_interleave(MXFP4_GROUP, 1)[:, :k]
        return decode_e2m1(codes) * scale
    if weight.format == DENSE:
        return rows.float()
    return integer_rows(weight, start, stop).float() * weight.scale[start:stop, None]


def quant_matmul_ref(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    n = weight.out_features
    step = weight.block if weight.format == FP8 else _REF_ROWS
    if weight.format in INTEGER_FORMATS:
        xq, xs = quantize_int8_ref(x)
        # fp32 holds the int32 sums exactly while K * 127**2 < 2**24, and rounds like fp32 beyond.
        rows = (integer_rows(weight, n0, min(n0 + step, n)) for n0 in range(0, n, step))
        y = torch.cat([xq.float() @ tile.float().T for tile in rows], dim=1)
        return (y * xs[:, None] * weight.scale[None, :]).to(x.dtype)
    xf = x.float()
    if weight.format == DENSE:  # nothing to decode: one product
        return (xf @ weight.data.float().T).to(x.dtype)
    tiles = [xf @ dequantize_rows(weight, n0, min(n0 + step, n)).T for n0 in range(0, n, step)]
    return torch.cat(tiles, dim=1).to(x.dtype)


# Kernels.


@triton.jit
def _e8m0(e):
    bits = tl.where(e == 0, 0x00400000, e << 23)
    bits = tl.where(e == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(b):
    exp = (b >> 3) & 15
    man = b & 7
    normal = (((b & 128) << 24) | ((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    sub = man.to(tl.float32) * 0.001953125  # 2**-9: the subnormal step
    sub = tl.where((b & 128) != 0, -sub, sub)
    value = tl.where(exp == 0, sub, normal)
    return tl.where((b & 127) == 127, float("nan"), value)


@triton.jit
def _e2m1(c):
    exp = (c >> 1) & 3
    man = c & 1
    bits = tl.where(exp == 0, man * (126 << 23), ((exp + 126) << 23) | (man << 22))
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_slice(w_ptr, s_ptr, n0, cols, col_ok, k0, K, SK, SCALE_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):  # fmt: skip
    """Weights ``[BLOCK_N, BLOCK_K]`` of inputs ``k0 + j`` in fp32 (0 past ``K`` or ``N``)."""
    GROUP: tl.constexpr = SCALE_BLOCK if SCALE_BLOCK < BLOCK_K else BLOCK_K
    kk = k0 + tl.arange(0, BLOCK_K)
    b = tl.load(w_ptr + cols[:, None] * K + kk[None, :], mask=col_ok[:, None] & (kk < K)[None, :], other=0)
    # BLOCK_N divides SCALE_BLOCK: the tile's rows share one row of exponents.
    groups = k0 // SCALE_BLOCK + tl.arange(0, BLOCK_K // GROUP)
    e = tl.load(s_ptr + (n0 // SCALE_BLOCK) * SK + groups, mask=groups < SK, other=127)
    w = (
        tl.reshape(_e4m3(b.to(tl.int32)), [BLOCK_N, BLOCK_K // GROUP, GROUP])
        * _e8m0(e.to(tl.int32))[None, :, None]
    )
    return tl.reshape(w, [BLOCK_N, BLOCK_K])


@triton.jit
def _mxfp4_slice(w_ptr, s_ptr, cols, col_ok, k0, K, SK, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weights of inputs ``k0 + 2j`` (low nibbles) and ``k0 + 2j + 1`` (high), ``[BLOCK_N, BLOCK_K / 2]``
    each, in fp32 (0 past ``K`` or ``N``)."""
    HALF: tl.constexpr = BLOCK_K // 2
    jj = k0 // 2 + tl.arange(0, HALF)
    b = tl.load(
        w_ptr + cols[:, None] * (K // 2) + jj[None, :], mask=col_ok[:, None] & (jj < K // 2)[None, :], other=0
    )
    groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    e = tl.load(
        s_ptr + cols[:, None] * SK + groups[None, :], mask=col_ok[:, None] & (groups < SK)[None, :], other=127
    )
    scale = _e8m0(e.to(tl.int32))[:, :, None]
    b = b.to(tl.int32)
    lo = tl.reshape(tl.reshape(_e2m1(b & 15), [BLOCK_N, BLOCK_K // 32, 16]) * scale, [BLOCK_N, HALF])
    hi = tl.reshape(tl.reshape(_e2m1(b >> 4), [BLOCK_N, BLOCK_K // 32, 16]) * scale, [BLOCK_N, HALF])
    return lo, hi


@triton.jit
def packed_matmul_tile(
    a_rows,
    row_ok,
    w_ptr,
    s_ptr,
    w2_ptr,
    s2_ptr,
    n0,
    N,
    K,
    SK,
    A_GATHERED: tl.constexpr,
    PAIR: tl.constexpr,
    FORMAT: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``a [BLOCK_M, K] @ dequant(W[n0 : n0 + BLOCK_N])^T`` in fp32 (``SK`` exponent columns); with ``PAIR``
    also the same for a second weight ``(w2_ptr, s2_ptr)`` of W's shape, sharing every load of ``a``.

    ``a_rows`` [BLOCK_M, 1] points at the rows of ``a`` (fp32 or bf16), ``row_ok`` marks the real ones.
    Weight and affine ``a`` addresses are a tile plus range masks, which triton-ascend keeps as a
    rectangular sub-view (no lane outside it is read). ``A_GATHERED`` rows (token ids) are a gather,
    whose mask the adapter drops: the caller passes valid rows and the columns are clamped here."""
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if FORMAT == 0:
            kk = k0 + tl.arange(0, BLOCK_K)
            ka = tl.minimum(kk, K - 1) if A_GATHERED else kk
            a = tl.load(a_rows + ka[None, :], mask=row_ok[:, None] & (kk < K)[None, :], other=0.0).to(
                tl.float32
            )
            w = _fp8_slice(w_ptr, s_ptr, n0, cols, col_ok, k0, K, SK, SCALE_BLOCK, BLOCK_N, BLOCK_K)
            acc += tl.dot(a, tl.trans(w), input_precision="ieee")
            if PAIR:
                w = _fp8_slice(w2_ptr, s2_ptr, n0, cols, col_ok, k0, K, SK, SCALE_BLOCK, BLOCK_N, BLOCK_K)
                acc2 += tl.dot(a, tl.trans(w), input_precision="ieee")
        elif FORMAT == 2:  # dense fp32 / bf16 weights
            kk = k0 + tl.arange(0, BLOCK_K)
            ka = tl.minimum(kk, K - 1) if A_GATHERED else kk
            a = tl.load(a_rows + ka[None, :], mask=row_ok[:, None] & (kk < K)[None, :], other=0.0).to(
                tl.float32
            )
            w_mask = col_ok[:, None] & (kk < K)[None, :]
            w = tl.load(w_ptr + cols[:, None] * K + kk[None, :], mask=w_mask, other=0.0).to(tl.float32)
            acc += tl.dot(a, tl.trans(w), input_precision="ieee")
            if PAIR:
                w = tl.load(w2_ptr + cols[:, None] * K + kk[None, :], mask=w_mask, other=0.0).to(tl.float32)
                acc2 += tl.dot(a, tl.trans(w), input_precision="ieee")
        else:
            jj = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            ja = tl.minimum(jj, K // 2 - 1) if A_GATHERED else jj
            a_mask = row_ok[:, None] & (jj < K // 2)[None, :]
            a_even = tl.load(a_rows + 2 * ja[None, :], mask=a_mask, other=0.0).to(tl.float32)
            a_odd = tl.load(a_rows + 2 * ja[None, :] + 1, mask=a_mask, other=0.0).to(tl.float32)
            lo, hi = _mxfp4_slice(w_ptr, s_ptr, cols, col_ok, k0, K, SK, BLOCK_N, BLOCK_K)
            acc += tl.dot(a_even, tl.trans(lo), input_precision="ieee")
            acc += tl.dot(a_odd, tl.trans(hi), input_precision="ieee")
            if PAIR:
                lo, hi = _mxfp4_slice(w2_ptr, s2_ptr, cols, col_ok, k0, K, SK, BLOCK_N, BLOCK_K)
                acc2 += tl.dot(a_even, tl.trans(lo), input_precision="ieee")
                acc2 += tl.dot(a_odd, tl.trans(hi), input_precision="ieee")
    return acc, acc2


@triton.jit
def _tile(task, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """First output row and column of a task."""
    n_tiles = tl.cdiv(N, BLOCK_N)
    return (task // n_tiles) * BLOCK_M, (task % n_tiles) * BLOCK_N


@triton.jit
def _packed_matmul_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    K,
    SK,
    FORMAT: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    for task in range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N), tl.num_programs(0)):
        m0, n0 = _tile(task, N, BLOCK_M, BLOCK_N)
        rows = m0 + tl.arange(0, BLOCK_M)
        cols = n0 + tl.arange(0, BLOCK_N)
        a_rows = x_ptr + rows[:, None] * K
        acc, _ = packed_matmul_tile(a_rows, rows < M, w_ptr, s_ptr, w_ptr, s_ptr, n0, N, K, SK, False, False,
                                    FORMAT, SCALE_BLOCK, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _int_slice(w_ptr, wrows, wrow_ok, kk, k_ok, K, shift, INT4: tl.constexpr):
    """int8 codes ``[BLOCK_N, BLOCK_K]`` of weight rows ``wrows`` (byte rows for int4, whose nibble
    ``shift`` selects: 28 the low one, 24 the high one), 0 past ``K`` or the rows."""
    b = tl.load(w_ptr + wrows[:, None] * K + kk[None, :], mask=wrow_ok[:, None] & k_ok[None, :], other=0)
    if INT4:
        b = ((b.to(tl.int32) << shift) >> 28).to(tl.int8)  # arithmetic shift: a signed nibble
    return b


@triton.jit
def int_matmul_tile(
    a_rows,
    row_ok,
    w_ptr,
    w2_ptr,
    wrows,
    wrow_ok,
    K,
    shift,
    A_GATHERED: tl.constexpr,
    PAIR: tl.constexpr,
    INT4: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``a_q [BLOCK_M, K] int8 @ W_q[wrows]^T`` in int32 (with ``PAIR`` also for a second weight of W's
    shape, sharing the loads of ``a``); ``a_rows`` as in ``packed_matmul_tile``."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        ka = tl.minimum(kk, K - 1) if A_GATHERED else kk
        a = tl.load(a_rows + ka[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0)
        acc += tl.dot(
            a, tl.trans(_int_slice(w_ptr, wrows, wrow_ok, kk, k_ok, K, shift, INT4)), out_dtype=tl.int32
        )
        if PAIR:
            w = _int_slice(w2_ptr, wrows, wrow_ok, kk, k_ok, K, shift, INT4)
            acc2 += tl.dot(a, tl.trans(w), out_dtype=tl.int32)
    return acc, acc2


@triton.jit
def _int8_matmul_kernel(
    xq_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    M,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    for task in range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N), tl.num_programs(0)):
        m0, n0 = _tile(task, N, BLOCK_M, BLOCK_N)
        rows = m0 + tl.arange(0, BLOCK_M)
        cols = n0 + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < M, cols < N
        acc, _ = int_matmul_tile(xq_ptr + rows[:, None] * K, row_ok, w_ptr, w_ptr, cols, col_ok, K, 0,
                                 False, False, False, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
        xs = tl.load(xs_ptr + rows, mask=row_ok, other=0.0)
        y = acc.to(tl.float32) * xs[:, None] * tl.load(ws_ptr + cols, mask=col_ok, other=0.0)[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def quant_matmul_triton(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    m, (n, k) = x.shape[0], (weight.out_features, weight.in_features)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out

    tuned = _int8_tuned if weight.format == INT8 else _packed_tuned

    def grid(meta: dict[str, int]) -> tuple[int]:
        return tuned.grid(triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]))

    if weight.format == INT8:
        xq, xs = quantize_int8_ref(x)
        _int8_tuned[grid](xq, xs, weight.data, weight.scale, out, m, n, k)
        return out
    fmt, sk = FORMAT_IDS[weight.format], weight.scale.shape[-1]
    _packed_tuned[grid](
        x.contiguous(), weight.data, weight.scale, out, m, n, k, sk, FORMAT=fmt, SCALE_BLOCK=weight.block
    )
    return out


def packed_ub(block_m: int, block_n: int, block_k: int) -> int:
    """Footprint of one ``packed_matmul_tile`` step: the activation slice (fp32), the weight bytes, about
    four int32/fp32 decode tiles of the weight slice, the exponents, and the accumulator and its copy."""
    return 4 * block_m * block_k + block_n * block_k * (1 + 4 * 4) + 4 * 2 * block_m * block_n


def _int8_ub(block_m: int, block_n: int, block_k: int) -> int:
    # Both int8 operand tiles and the transposed weight tile, then the int32 accumulator, the dot result
    # and the rescaled fp32 tile.
    return (block_m + 2 * block_n) * block_k + 4 * 3 * block_m * block_n


# BLOCK_K = 128: a multiple of every scale group (32 and 128), and 512 B of fp32 per cube operand row;
# BLOCK_N = 32 divides both FP8 blocks, as packed_matmul_tile needs.
PACKED_CONFIGS = (
    TuneConfig({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128}, packed_ub(16, 32, 128)),
    TuneConfig({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 128}, packed_ub(32, 32, 128)),
    TuneConfig({"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 128}, packed_ub(64, 32, 128), multibuffer=False),
)
_INT8_CONFIGS = tuple(
    TuneConfig({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 256}, _int8_ub(bm, bn, 256), multibuffer)
    for bm, bn, multibuffer in ((16, 64, True), (32, 128, False), (64, 128, False))
)


def _packed_signature(x: str) -> dict[str, str]:
    return {
        "x_ptr": x,
        "w_ptr": "*u8",
        "s_ptr": "*u8",
        "out_ptr": x,
        **dict.fromkeys(("M", "N", "K", "SK"), "i32"),
    }


def _int8_signature(out: str) -> dict[str, str]:
    operands = {"xq_ptr": "*i8", "xs_ptr": "*fp32", "w_ptr": "*i8", "ws_ptr": "*fp32", "out_ptr": out}
    return {**operands, **dict.fromkeys(("M", "N", "K"), "i32")}


_packed_tuned = tuning.TunedKernel(
    _packed_matmul_kernel,
    PACKED_CONFIGS,
    key=["N", "K", "FORMAT", "SCALE_BLOCK"],
    variants=tuple(
        Variant(
            {"FORMAT": fmt, "SCALE_BLOCK": block}, (_packed_signature("*fp32"), _packed_signature("*bf16"))
        )
        for fmt, block in ((0, 128), (0, 32), (1, MXFP4_GROUP))
    ),
    uses_cube=True,
    # MXFP4 packs whole 32-value groups, so K >= 32; the adapter crashes on an MXFP4 K of 1.
    never_one=("K",),
)
_int8_tuned = tuning.TunedKernel(
    _int8_matmul_kernel,
    _INT8_CONFIGS,
    key=["N", "K"],
    variants=(Variant({}, (_int8_signature("*fp32"), _int8_signature("*bf16"))),),
    uses_cube=True,
)
KERNELS = (_packed_tuned, _int8_tuned)
