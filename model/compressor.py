"""KV compressor: one entry per ``ratio`` tokens, softmax-gated per channel (model-spec §4.5, §4.7).

V4 ratio 4 (CSA) pools two overlapping windows: entry g mixes the Ca half of group g-1 with the Cb
half of group g over 2*ratio slots; V4 ratio 128 (HCA) and V4.1 ratio 2 pool their own group
only; V4.1 ratio 1 is a projection and a norm. The projections are
GEMMs here; the pooling, norm, rotation and state update are the ``compress`` op, whose state (the
open group's raw projections and the last group's Ca half) makes any chunking of the input give
the entries of a one-shot pass.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from model.layers import RMSNorm, linear
from model.quant_linear import StackedRows, stack_rows
from triton_kernels.compressor import CompressBatch, CompressorParams, CompressorStates
from triton_kernels.custom_ops import compress

if TYPE_CHECKING:
    from model.cache import Batch


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
    """One request: the op's state (its open window and overlap slice, row 0) and the tokens seen; ``pending``
    is row ``row`` of the batch state ``stack`` while the request stays in the same batch."""

    pending: CompressorStates
    num_tokens: int = 0
    journal: Journal | None = None
    stack: CompressorStates | None = None
    row: int = 0

    def speculate(self) -> None:
        """Journal the next calls, so that ``rollback`` can keep a prefix of their tokens."""
        # Cloned field by field: the state may be a row view of a batch's stacked states.
        saved = CompressorStates(*(None if t is None else t.clone() for t in vars(self.pending).values()))
        self.journal = Journal(saved, self.num_tokens)

    def rollback(self, keep: int) -> None:
        """The state as if only the first ``keep`` tokens since ``speculate`` had come: the saved state
        advanced by the op over their journaled projections (storing no entry: those are in the pool)."""
        journal, self.journal = self.journal, None
        if journal is None or journal.num_tokens + keep == self.num_tokens:
            return
        self.pending, self.num_tokens, self.stack = journal.saved, journal.num_tokens + keep, None
        if keep and journal.params is not None:
            kv = torch.cat(journal.kv)[:keep]
            gate = torch.cat(journal.gate)[:keep] if journal.gate else None
            slots = torch.full((keep,), -1, dtype=torch.int32, device=kv.device)
            batch = CompressBatch.single(journal.params.ratio, journal.num_tokens, slots)
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
        self.kv_gate: StackedRows | None = None

    def stack_projections(self) -> None:
        """``wkv`` and ``wgate`` as one GEMM (before the weights load into its rows)."""
        if self.ratio > 1:
            self.kv_gate = stack_rows(self.wkv, self.wgate)

    def new_state(self, device: torch.device) -> CompressorState:
        return CompressorState(CompressorStates.empty(1, self.ratio, self.dim, self.overlap, device))

    def states_of(
        self, owners: list[dict[int, CompressorState]], layer: int, device: torch.device
    ) -> list[CompressorState]:
        """Each request's state at ``layer`` (``owners``: the requests' states by layer); new if missing."""
        return [o[layer] if layer in o else o.setdefault(layer, self.new_state(device)) for o in owners]

    def pool(
        self, x: torch.Tensor, state: CompressorState, inv_freq: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        """One request's entries (as ``pool_batch``) of the groups ``x [S, D]`` closes, and the first one's
        index."""
        first = state.num_tokens // self.ratio
        entries, _, _ = self.pool_batch(x, [(0, x.shape[0])], [state], inv_freq)
        return entries, first

    def pool_batch(
        self,
        x: torch.Tensor,
        bounds: list[tuple[int, int]],
        states: list[CompressorState],
        inv_freq: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed entries ``[E, c]`` (fp32) of the groups that each request's rows ``x[lo:hi]`` close, with
        the request ``[E]`` and the number ``[E]`` of each: one projection and one ``compress`` for all.

        Entries are rotated at their group's first position when ``inv_freq`` is given (V4), the
        un-rotated latents otherwise (V4.1 derives its index keys from them).
        """
        starts = tuple(s.num_tokens for s in states)
        lengths = tuple(hi - lo for lo, hi in bounds)
        batch, request, numbers = _batch_meta(self.ratio, starts, lengths, x.device)
        params, kv, gate, entries = self._compress(x, batch, _batch_state(states), inv_freq, len(request))
        _advance(states, bounds, params, kv, gate)
        return entries, request, numbers

    def pool_step(
        self, x: torch.Tensor, batch: Batch, owner: str, layer: int, inv_freq: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``pool_batch`` over a step, the states being the requests' ``owner`` ("compressors" or
        "indexers") at ``layer``. In a step of fixed shape every token has an output row (the batch holds
        the metadata) and the states' bookkeeping waits for the batch's ``finish``."""
        states = self.states_of([getattr(s, owner) for s in batch.seqs], layer, x.device)
        meta = batch.compress.get(self.ratio)
        if meta is None:
            return self.pool_batch(x, batch.bounds, states, inv_freq)
        params, kv, gate, entries = self._compress(
            x, meta.batch, _batch_state(states), inv_freq, len(meta.request)
        )

        def advance(batch: Batch, kv: torch.Tensor, *gate: torch.Tensor) -> None:
            states = [getattr(s, owner)[layer] for s in batch.live_seqs]
            if any(s.journal is not None for s in states):  # kept past the step: a graph reuses its outputs
                kv, gate = kv.clone(), tuple(g.clone() for g in gate)
            _advance(states, batch.bounds, params, kv, gate[0] if gate else None)

        batch.after(advance, kv, *(() if gate is None else (gate,)))
        return entries, meta.request, meta.numbers

    def _compress(
        self,
        x: torch.Tensor,
        batch: CompressBatch,
        stacked: CompressorStates,
        inv_freq: torch.Tensor | None,
        rows: int,
    ) -> tuple[CompressorParams, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Project ``x`` and run ``compress`` into ``rows`` output rows."""
        params = CompressorParams(
            self.ratio, self.overlap, self.norm.weight, self.norm.eps, getattr(self, "ape", None), inv_freq
        )
        if self.kv_gate is not None:
            kv, gate = self.kv_gate(x)
        else:
            kv, gate = self.wkv(x), self.wgate(x) if self.ratio > 1 else None
        entries = torch.empty(rows, self.dim, device=x.device)
        compress(kv, gate, batch, stacked, params, entries)
        return params, kv, gate, entries


def _advance(
    states: list[CompressorState],
    bounds: list[tuple[int, int]],
    params: CompressorParams,
    kv: torch.Tensor,
    gate: torch.Tensor | None,
) -> None:
    """The states have seen their requests' rows of ``kv``; journaling ones keep them (with ``params``)."""
    for state, (lo, hi) in zip(states, bounds, strict=False):  # padding rows have no state here
        if state.journal is not None:
            state.journal.params = params
            state.journal.kv.append(kv[lo:hi])
            state.journal.gate.extend([] if gate is None else [gate[lo:hi]])
        state.num_tokens += hi - lo


@functools.lru_cache(maxsize=16)
def _batch_meta(
    r: int, starts: tuple[int, ...], lengths: tuple[int, ...], device: torch.device
) -> tuple[CompressBatch, torch.Tensor, torch.Tensor]:
    """The op's batch of requests that have seen ``starts`` tokens and bring ``lengths`` more (as
    ``CompressBatch.build``), with the request and the number of each entry they close. Every compressor
    of a ratio in a step asks for the same: cached (the tensors are only read). Host metadata: numpy, a
    fraction of torch's cost per call."""
    n = len(starts)
    start, length = np.array(starts, dtype=np.int64), np.array(lengths, dtype=np.int64)
    firsts, counts = start // r, (start + length) // r - start // r
    # Each token's position, and its entry's row in the output where it closes a group.
    token_request = np.repeat(np.arange(n), length)
    token_base, entry_base = length.cumsum() - length, counts.cumsum() - counts
    positions = start[token_request] + np.arange(len(token_request)) - token_base[token_request]
    row = entry_base[token_request] + (positions + 1) // r - 1 - firsts[token_request]
    closes = (positions + 1) % r == 0
    slots = np.where(closes, row, -1)
    order = np.argsort(~closes, kind="stable")  # as closing_first
    request = np.repeat(np.arange(n), counts)
    numbers = firsts[request] + np.arange(len(request)) - entry_base[request]
    cu = np.concatenate([[0], length.cumsum()])
    fields = (cu, start, np.arange(n), slots, token_request, order)
    meta = torch.from_numpy(np.concatenate(fields).astype(np.int32)).to(device)
    batch = CompressBatch(*meta.split([len(f) for f in fields]))
    return batch, torch.from_numpy(request).to(device), torch.from_numpy(numbers).to(device)


def _batch_state(states: list[CompressorState]) -> CompressorStates:
    """The requests' states as the rows of one, in order: the last call's when the requests are the same
    (each request's state is a row view of it), else stacked anew."""
    stack = states[0].stack
    if (
        stack is not None
        and stack.buffer_kv.shape[0] == len(states)
        and all(s.stack is stack and s.row == b for b, s in enumerate(states))
    ):
        return stack
    stack = _stacked([s.pending for s in states])
    for b, state in enumerate(states):
        state.pending = CompressorStates(*(None if t is None else t[b : b + 1] for t in vars(stack).values()))
        state.stack, state.row = stack, b
    return stack


def _stacked(states: list[CompressorStates]) -> CompressorStates:
    """The requests' one-row states as the rows of one state, in order."""
    fields = [[getattr(s, f.name) for s in states] for f in dataclasses.fields(CompressorStates)]
    return CompressorStates(*(None if rows[0] is None else torch.cat(rows) for rows in fields))


def adopt(states: list[CompressorState], stack: CompressorStates, owners: list[CompressorState]) -> None:
    """Make ``states`` the rows of ``stack``, a stack kept across steps (a graph's), in order: each is
    copied in unless it already is its row. ``owners`` names each row's state and is updated; a former
    owner that still views its row gets its own copy first."""
    for row, state in enumerate(states):
        if state.stack is stack and state.row == row:
            owners[row] = state
            continue
        former = owners[row]
        if former is not state and former.stack is stack and former.row == row:
            former.pending = CompressorStates(
                *(None if t is None else t.clone() for t in vars(former.pending).values())
            )
            former.stack = None
        view = CompressorStates(*(None if t is None else t[row : row + 1] for t in vars(stack).values()))
        for target, source in zip(vars(view).values(), vars(state.pending).values(), strict=True):
            if target is not None:
                target.copy_(source)
        state.pending, state.stack, state.row = view, stack, row
        owners[row] = state
