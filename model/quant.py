"""Quantised weights of the official checkpoints: dequantise on load, quantise for tiny checkpoints.

- FP8: F8_E4M3 ``[out, in]`` with a sibling F8_E8M0 ``scale``; the value is ``q * 2**(e - 127)``.
  Linears are scaled per ``B x B`` block (scale ``[ceil(out/B), ceil(in/B)]``); Engram tables per
  row and ``B`` channels (scale ``[out, ceil(in/B)]``).
- MXFP4 (routed experts): I8 ``[out, in/2]``, two E2M1 codes per byte, the low nibble first, and
  an E8M0 scale per 32 inputs (``[out, in/32]``).

E2M1 codes decode as the kernels decode them (``quant_matmul.decode_e2m1``); E4M3 and E8M0 through torch's
float8 dtypes, which ``quant_matmul``'s decoders match bit for bit.
"""

from __future__ import annotations

import torch

from triton_kernels.quant_matmul import MXFP4_GROUP, decode_e2m1

FP8_MAX = 448.0  # largest finite E4M3 value
_E2M1 = decode_e2m1(torch.arange(16))  # every code's value, for the nearest-code search


def _expand_blocks(scale: torch.Tensor, shape: torch.Size, block: int) -> torch.Tensor:
    rows, cols = shape
    row_block = 1 if scale.shape[0] == rows else block  # per-row groups (Engram) or square blocks
    return scale.repeat_interleave(row_block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """E4M3 ``weight [out, in]`` times its E8M0 block ``scale`` -> ``dtype``."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(
            f"FP8 weight must be a 2-D float8_e4m3fn tensor, got {weight.dtype} {tuple(weight.shape)}"
        )
    rows, cols = weight.shape
    expected = [(-(-rows // block), -(-cols // block)), (rows, -(-cols // block))]
    if tuple(scale.shape) not in expected:
        raise ValueError(
            f"FP8 scale shape {tuple(scale.shape)} does not match weight {tuple(weight.shape)} "
            f"with block {block}: expected one of {expected}"
        )
    if scale.dtype == torch.float8_e8m0fnu and bool((scale.view(torch.uint8) == 255).any()):
        raise ValueError("FP8 scale holds the E8M0 NaN byte 255")
    return (weight.float() * _expand_blocks(scale.float(), weight.shape, block)).to(dtype)


def quantize_fp8(
    weight: torch.Tensor, block: int, row_block: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Round ``weight [out, in]`` to E4M3 with one power-of-two (E8M0) scale per ``row_block x block``
    group (``row_block`` defaults to ``block``; 1 gives the per-row scales of Engram tables)."""
    rows, cols = weight.shape
    row_block = row_block or block
    padded = torch.zeros(-(-rows // row_block) * row_block, -(-cols // block) * block)
    padded[:rows, :cols] = weight.float().abs()
    amax = padded.view(padded.shape[0] // row_block, row_block, -1, block).amax(dim=(1, 3)).clamp_min(1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    q = (weight.float() / _expand_blocks(scale, weight.shape, block)).to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 ``packed [out, in/2]`` (int8, low nibble first) with E8M0 ``scale [out, in/32]`` -> ``dtype``."""
    if packed.dtype not in (torch.int8, torch.uint8) or packed.dim() != 2:
        raise ValueError(f"FP4 weight must be a 2-D int8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    rows, cols = packed.shape[0], packed.shape[1] * 2
    if tuple(scale.shape) != (rows, -(-cols // MXFP4_GROUP)):
        raise ValueError(f"FP4 scale shape {tuple(scale.shape)} does not match {rows} x {cols} weights")
    codes = packed.view(torch.uint8)
    values = decode_e2m1(torch.stack([codes & 0xF, codes >> 4], dim=-1)).view(rows, cols)
    return (values * scale.float().repeat_interleave(MXFP4_GROUP, 1)[:, :cols]).to(dtype)


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round ``weight [out, in]`` (``in`` even) to MXFP4 codes with one E8M0 scale per 32 inputs."""
    rows, cols = weight.shape
    groups = weight.float().view(rows, -1, MXFP4_GROUP) if cols % MXFP4_GROUP == 0 else None
    if groups is None or cols % 2:
        raise ValueError(f"FP4 weight inputs {cols} must be a multiple of {MXFP4_GROUP}")
    scale = torch.exp2(torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6.0)))
    scaled = (groups / scale[..., None]).view(rows, cols)
    codes = (scaled[..., None] - _E2M1).abs().argmin(dim=-1).to(torch.uint8)  # nearest representable
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu)
