"""Small modules shared by every block."""

from __future__ import annotations

import torch
from torch import nn

from model.config import ModelConfig
from model.plan import Rope
from model.quant_linear import DenseLinear
from triton_kernels.custom_ops import apply_rope, hc_collapse, rms_norm
from triton_kernels.rope import rope_inv_freq


class RMSNorm(nn.Module):
    """Weighted RMSNorm; the weight is kept and applied in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def rotated(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        store: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``apply_rope(self(x), positions, inv_freq)``, in one op; ``store`` (a cache pool, slots): the
        rows also stored there."""
        cache, slots = store or (None, None)
        return apply_rope(
            x, positions, inv_freq, norm_eps=self.eps, norm_weight=self.weight, cache=cache, slots=slots
        )

    def collapsed(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """``self(hc_collapse(streams, pre))``, in one op: a sublayer's input."""
        return hc_collapse(streams, pre, self.weight, self.eps)


def linear(hidden: int, out: int) -> DenseLinear:
    """A model linear: dense as built, swapped for a packed one by the loader where the checkpoint is."""
    return DenseLinear(hidden, out)


class RopeFrequencies(nn.Module):
    """The two rope frequency tables: ``main`` (no YaRN) and ``compress`` (YaRN), not checkpointed."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("main", torch.empty(cfg.qk_rope_head_dim // 2), persistent=False)
        self.register_buffer("compress", torch.empty(cfg.qk_rope_head_dim // 2), persistent=False)
        self.fill()

    def fill(self) -> None:
        """Compute the tables (again once a model built on ``meta`` is materialised)."""
        if self.main.is_meta:
            return
        cfg = self.cfg
        self.main.copy_(rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, None))
        self.compress.copy_(rope_inv_freq(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling))

    def forward(self, rope: Rope) -> torch.Tensor:
        return self.main if rope is Rope.MAIN else self.compress


def check_token_ids(ids: torch.Tensor, vocab_size: int) -> None:
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"token ids must be a 1-D integer tensor, got {ids.dtype} {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError("token ids are empty: at least one token is required")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"token id {low if low < 0 else high} is outside the vocabulary [0, {vocab_size})")
