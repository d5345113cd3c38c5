"""What a proposer sees after a step and hands back; the scripted proposer (tests, benchmarks)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.request import Proposal, Request
from model.cache import SeqCache


@dataclass
class Observation:
    """One request's chunk of the step that just ran, cut to the tokens it committed."""

    request: Request
    seq: SeqCache  # its cache (tables, and the position it has reached)
    start: int  # position of the chunk's first token
    features: torch.Tensor  # [committed, ...]: the draft head's input for each committed token
    num_drafts: int  # drafts wanted for the next step (0: only take the tokens in)
    # The token after each committed one (the last: the one the step sampled, or the next prompt token);
    # None: read from the request. A tensor-parallel worker, which holds no requests, is given them.
    next_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if self.next_ids is None:
            start = self.start + 1
            self.next_ids = self.request.tokens[start : start + self.features.shape[0]]


class Proposer(ABC):
    lookahead: int = 0  # KV positions past a sampling chunk that its drafting writes

    @abstractmethod
    def propose(self, observations: list[Observation]) -> list[Proposal | None]:
        """Take the committed tokens in; a proposal for each observation that wants drafts, else None.

        Every chunk of every step is observed, in order, so a proposer can keep per-request context;
        a chunk starting at position 0 is a request starting (again, after a preemption)."""

    def release(self, request_id: str) -> None:  # noqa: B027 (most proposers keep nothing per request)
        """The request is done: forget it."""

    def forwards(self, observations: list[Observation]) -> int:
        """How many forwards of the draft layers ``propose`` runs over ``observations``."""
        return 0

    def idle(self) -> None:  # noqa: B027 (a proposer without draft layers has nothing to dispatch)
        """One draft forward's collectives with no token (data parallel: another rank drafts)."""


class ScriptedProposer(Proposer):
    """Proposes what ``script(request, k)`` returns (at most k tokens), deterministically."""

    def __init__(self, script: Callable[[Request, int], list[int]]):
        self.script = script

    def propose(self, observations: list[Observation]) -> list[Proposal | None]:
        return [
            Proposal(self.script(o.request, o.num_drafts)[: o.num_drafts]) if o.num_drafts else None
            for o in observations
        ]
