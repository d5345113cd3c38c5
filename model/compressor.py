"""V4 KV compressor: one entry per ``ratio`` tokens, softmax-gated per channel (model-spec §4.5).

Ratio 4 (CSA) pools two overlapping windows: entry g mixes the Ca half of group g-1 with the Cb
half of group g over 2*ratio slots. Ratio 128 (HCA) pools its own group only. The state carries
the open group's raw projections and the last group's Ca half, so any chunking of the input
gives the entries of a one-shot pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from model.layers import RMSNorm, linear
from triton_kernels.rope import apply_rope


@dataclass
class CompressorState:
    buffer_kv: torch.Tensor  # [t_seen mod ratio, coff*c]: raw wkv·x of the open group
    buffer_gate: torch.Tensor  # same, raw wgate·x (ape is added when the group closes)
    entries: torch.Tensor  # [entry_count, c]: emitted entries, normed and rotated
    overlap_kv: torch.Tensor | None = None  # [ratio, c]: Ca half of the last closed group
    overlap_gate: torch.Tensor | None = None  # same for the gate, ape included

    @classmethod
    def empty(cls, width: int, dim: int, device: torch.device) -> CompressorState:
        return cls(
            torch.zeros(0, width, device=device),
            torch.zeros(0, width, device=device),
            torch.zeros(0, dim, device=device),
        )


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
        return CompressorState.empty(self.wkv.out_features, self.dim, device)

    def pool(self, x: torch.Tensor, state: CompressorState | None) -> tuple[torch.Tensor, int]:
        """Normed, un-rotated entries of the groups that ``x [S, D]`` closes, and the first one's index.

        Without a state the complete groups of ``x`` are compressed and the rest is dropped.
        """
        kv = self.wkv(x).float()
        if self.ratio == 1:
            first = state.entries.shape[0] if state is not None else 0
            return self.norm(kv), first
        gate = self.wgate(x).float()
        first = 0
        if state is not None:
            first = state.entries.shape[0]
            kv, gate = torch.cat([state.buffer_kv, kv]), torch.cat([state.buffer_gate, gate])
        groups = kv.shape[0] // self.ratio
        usable = groups * self.ratio
        if state is not None:
            state.buffer_kv, state.buffer_gate = kv[usable:], gate[usable:]
        if groups == 0:  # no group closes: the overlap state stays as it is
            return kv.new_zeros(0, self.dim), first
        kv = kv[:usable].view(groups, self.ratio, -1)
        gate = gate[:usable].view(groups, self.ratio, -1)
        if hasattr(self, "ape"):
            gate = gate + self.ape.float()
        if self.overlap:
            kv, gate = self._overlap_slots(kv, gate, state)
        return self.norm((kv * gate.softmax(dim=1)).sum(dim=1)), first

    def rotate(self, latent: torch.Tensor, first: int, inv_freq: torch.Tensor) -> torch.Tensor:
        """RoPE of each entry at its group's first token position."""
        positions = (first + torch.arange(latent.shape[0], device=latent.device)) * self.ratio
        return apply_rope(latent, positions, inv_freq)

    def forward(self, x: torch.Tensor, inv_freq: torch.Tensor, state: CompressorState | None) -> torch.Tensor:
        """Every rotated entry so far ``[E, dim]`` (the V4 compressed KV)."""
        latent, first = self.pool(x, state)
        entries = self.rotate(latent, first, inv_freq)
        if state is None:
            return entries
        state.entries = torch.cat([state.entries, entries])
        return state.entries

    def _overlap_slots(
        self, kv: torch.Tensor, gate: torch.Tensor, state: CompressorState | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Lay out [Ca of group g-1 | Cb of group g] over 2*ratio slots for each group g."""
        c, r = self.dim, self.ratio
        slots_kv = kv.new_zeros(kv.shape[0], 2 * r, c)
        slots_gate = gate.new_full((kv.shape[0], 2 * r, c), float("-inf"))  # empty slots weigh 0
        slots_kv[:, r:], slots_gate[:, r:] = kv[..., c:], gate[..., c:]
        slots_kv[1:, :r], slots_gate[1:, :r] = kv[:-1, :, :c], gate[:-1, :, :c]
        if state is not None:
            if state.overlap_kv is not None:
                slots_kv[0, :r], slots_gate[0, :r] = state.overlap_kv, state.overlap_gate
            state.overlap_kv, state.overlap_gate = kv[-1, :, :c].clone(), gate[-1, :, :c].clone()
        return slots_kv, slots_gate
