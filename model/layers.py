"""Small modules shared by every block."""

from __future__ import annotations

import torch
from torch import nn

from triton_kernels.rmsnorm import rms_norm


class RMSNorm(nn.Module):
    """Weighted RMSNorm; the weight is kept and applied in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def linear(hidden: int, out: int) -> nn.Linear:
    return nn.Linear(hidden, out, bias=False)
