"""KV compressor: one entry per ``ratio`` tokens, softmax-gated per channel (model-spec §4.5, §4.7).

V4 ratio 4 (CSA) pools two overlapping windows: entry g mixes the Ca half of group g-1 with the Cb
half of group g over 2*ratio slots; V4 ratio 128 (HCA) and V4.1 ratio 2 pool their own group
only; V4.1 ratio 1 is a projection and a norm. The projections are
GEMMs here; the pooling, norm, rotation and state update are the ``compress`` op, whose state (the
open group's raw projections and the last group's Ca half) makes any chunking of the input give
the entries of a one-shot pass.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from model.layers import RMSNorm, linear
from triton_kernels.compressor import CompressBatch, CompressorParams, CompressorStates, compress


@dataclass
class Journal:
    """A call that may be partly rolled back: the state before it and the projections it consumed."""

    saved: CompressorStates
    num_tokens: int
    params: CompressorParams | None = None
    kv: list[torch.Tensor] = field(default_factory=list)
    gate: list[torch.Tensor] = field(default_factory=list)


@dataclass
class CompressorState:
    """One request: the op's state (its open window and overlap slice, row 0) and the tokens seen."""

    pending: CompressorStates
    num_tokens: int = 0
    journal: Journal | None = None

    def speculate(self) -> None:
        """Journal the next calls, so that ``rollback`` can keep a prefix of their tokens."""
        self.journal = Journal(copy.deepcopy(self.pending), self.num_tokens)

    def rollback(self, keep: int) -> None:
        """The state as if only the first ``keep`` tokens since ``speculate`` had come: the saved state
        advanced by the op over their journaled projections (storing no entry: those are in the pool)."""
        journal, self.journal = self.journal, None
        if journal is None or journal.num_tokens + keep == self.num_tokens:
            return
        self.pending, self.num_tokens = journal.saved, journal.num_tokens + keep
        if keep and journal.params is not None:
            kv = torch.cat(journal.kv)[:keep]
            gate = torch.cat(journal.gate)[:keep] if journal.gate else None
            slots = torch.full((keep,), -1, dtype=torch.int32, device=kv.device)
            batch = CompressBatch.single(journal.num_tokens, slots)
            scratch = torch.empty(1, journal.params.norm_weight.numel(), device=kv.device)
            compress(kv, gate, batch, self.pending, journal.params, scratch)


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
        kv, gate = self.wkv(x), self.wgate(x) if self.ratio > 1 else None
        if state.journal is not None:
            state.journal.params = params
            state.journal.kv.append(kv)
            state.journal.gate.extend([] if gate is None else [gate])
        compress(kv, gate, CompressBatch.single(start, slots), state.pending, params, entries)
        state.num_tokens += x.shape[0]
        return entries, first
