"""Block-scaled FP8 (E4M3 + E8M0) weights: dequantise on load, quantise for tiny checkpoints.

A weight ``[out, in]`` is stored as F8_E4M3 with a sibling F8_E8M0 ``scale`` of shape
``[ceil(out/B), ceil(in/B)]``; the value is ``q * 2**(e - 127)`` per ``B x B`` block.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite E4M3 value


def _expand_blocks(scale: torch.Tensor, shape: torch.Size, block: int) -> torch.Tensor:
    rows, cols = shape
    return scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """E4M3 ``weight [out, in]`` times its E8M0 block ``scale`` -> ``dtype``."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(
            f"FP8 weight must be a 2-D float8_e4m3fn tensor, got {weight.dtype} {tuple(weight.shape)}"
        )
    rows, cols = weight.shape
    expected = (-(-rows // block), -(-cols // block))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"FP8 scale shape {tuple(scale.shape)} does not match weight {tuple(weight.shape)} "
            f"with block {block}: expected {expected}"
        )
    if scale.dtype == torch.float8_e8m0fnu and bool((scale.view(torch.uint8) == 255).any()):
        raise ValueError("FP8 scale holds the E8M0 NaN byte 255")
    return (weight.float() * _expand_blocks(scale.float(), weight.shape, block)).to(dtype)


def quantize_fp8(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Round ``weight [out, in]`` to E4M3 with one power-of-two (E8M0) scale per block."""
    rows, cols = weight.shape
    w = weight.float()
    padded = torch.zeros(-(-rows // block) * block, -(-cols // block) * block)
    padded[:rows, :cols] = w.abs()
    amax = padded.view(padded.shape[0] // block, block, -1, block).amax(dim=(1, 3)).clamp_min(1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    q = (w / _expand_blocks(scale, weight.shape, block)).to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu)
