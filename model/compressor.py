"""V4 KV compressor: one entry per ``ratio`` tokens, softmax-gated per channel (model-spec §4.5).

Ratio 4 (CSA) pools two overlapping windows: entry g mixes the Ca half of group g-1 with the Cb
half of group g over 2*ratio slots. Ratio 128 (HCA) pools its own group only. The projections are
GEMMs here; the pooling, norm, rotation and state update are the ``compress`` op, whose state (the
open group's raw projections and the last group's Ca half) makes any chunking of the input give
the entries of a one-shot pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from model.layers import RMSNorm, linear
from triton_kernels.compressor import CompressBatch, CompressorParams, CompressorStates, compress
from triton_kernels.rope import apply_rope


@dataclass
class CompressorState:
    """One request: the op's state (row 0), the tokens seen and the entries emitted so far."""

    pending: CompressorStates
    entries: torch.Tensor  # [entry_count, c]: normed (and, for V4, rotated)
    num_tokens: int = 0


class Compressor(nn.Module):
    """``ratio`` tokens -> one entry. V4: gated with the learned position bias ``ape`` (ratio 4 also
    overlapping); V4.1: ratio 2 gated without ``ape``, ratio 1 a plain projection (no gate)."""

    def __init__(
        self, hidden: int, dim: int, ratio: int, eps: float, overlap: bool = False, ape: bool = True
    ):
        super().__init__()
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        width = (2 if overlap else 1) * dim
        self.wkv = linear(hidden, width)
        if ratio > 1:
            self.wgate = linear(hidden, width)
        if ape:
            self.ape = nn.Parameter(torch.empty(ratio, width))
        self.norm = RMSNorm(dim, eps)

    def new_state(self, device: torch.device) -> CompressorState:
        pending = CompressorStates.empty(1, self.ratio, self.dim, self.overlap, device)
        return CompressorState(pending, torch.zeros(0, self.dim, device=device))

    def pool(
        self, x: torch.Tensor, state: CompressorState | None, inv_freq: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        """Normed entries ``[E, c]`` (fp32) of the groups that ``x [S, D]`` closes, and the first one's index.

        Entries are rotated when ``inv_freq`` is given, the un-rotated latents otherwise. Without a
        state the complete groups of ``x`` are compressed and the rest is dropped.
        """
        start = state.num_tokens if state is not None else 0
        first = start // self.ratio
        positions = torch.arange(start, start + x.shape[0], dtype=torch.int32, device=x.device)
        closed = (positions + 1) // self.ratio  # groups closed once each token is in
        slots = torch.where((positions + 1) % self.ratio == 0, closed - 1 - first, -1).to(torch.int32)
        entries = torch.empty((start + x.shape[0]) // self.ratio - first, self.dim, device=x.device)
        params = CompressorParams(
            self.ratio, self.overlap, self.norm.weight, self.norm.eps, getattr(self, "ape", None), inv_freq
        )
        gate = self.wgate(x) if self.ratio > 1 else None
        pending = state.pending if state is not None else None
        compress(self.wkv(x), gate, CompressBatch.single(start, slots), pending, params, entries)
        if state is not None:
            state.num_tokens += x.shape[0]
        return entries, first

    def rotate(self, latent: torch.Tensor, first: int, inv_freq: torch.Tensor) -> torch.Tensor:
        """RoPE of each entry at its group's first token position."""
        positions = (first + torch.arange(latent.shape[0], device=latent.device)) * self.ratio
        return apply_rope(latent, positions, inv_freq)

    def forward(self, x: torch.Tensor, inv_freq: torch.Tensor, state: CompressorState | None) -> torch.Tensor:
        """Every rotated entry so far ``[E, dim]`` (the V4 compressed KV)."""
        entries, _ = self.pool(x, state, inv_freq)
        if state is None:
            return entries
        state.entries = torch.cat([state.entries, entries])
        return state.entries
