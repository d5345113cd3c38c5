"""KV compressor: one entry per ``ratio`` tokens, softmax-gated per channel (model-spec §4.5, §4.7).

V4 ratio 4 (CSA) pools two overlapping windows: entry g mixes the Ca half of group g-1 with the Cb
half of group g over 2*ratio slots; V4 ratio 128 (HCA) and V4.1 ratio 2 pool their own group
only; V4.1 ratio 1 is a projection and a norm. The projections are
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


@dataclass
class CompressorState:
    """One request: the op's state (its open window and overlap slice, row 0) and the tokens seen."""

    pending: CompressorStates
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
        return CompressorState(CompressorStates.empty(1, self.ratio, self.dim, self.overlap, device))

    def pool(
        self, x: torch.Tensor, state: CompressorState, inv_freq: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        """Normed entries ``[E, c]`` (fp32) of the groups that ``x [S, D]`` closes, and the first one's index.

        Entries are rotated at their group's first position when ``inv_freq`` is given (V4), the
        un-rotated latents otherwise (V4.1 derives its index keys from them).
        """
        start = state.num_tokens
        first = start // self.ratio
        positions = torch.arange(start, start + x.shape[0], dtype=torch.int32, device=x.device)
        closed = (positions + 1) // self.ratio  # groups closed once each token is in
        slots = torch.where((positions + 1) % self.ratio == 0, closed - 1 - first, -1).to(torch.int32)
        entries = torch.empty((start + x.shape[0]) // self.ratio - first, self.dim, device=x.device)
        params = CompressorParams(
            self.ratio, self.overlap, self.norm.weight, self.norm.eps, getattr(self, "ape", None), inv_freq
        )
        gate = self.wgate(x) if self.ratio > 1 else None
        compress(self.wkv(x), gate, CompressBatch.single(start, slots), state.pending, params, entries)
        state.num_tokens += x.shape[0]
        return entries, first
