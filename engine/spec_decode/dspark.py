"""DSpark proposer (model-spec §8.2; V4.1 and the V4-Flash-0731 / V4-Pro-0813 releases): a block of
drafts per request from the context keys of its committed positions; the confidence head can shorten
what is verified.

Context keys are only ever added for committed positions, so nothing of the draft needs rolling
back. With ``min_confidence`` > 0, a request verifies the longest draft prefix whose product of
confidences (the estimated chance that the whole prefix survives) stays at or above it; 0 verifies
every draft asked for.
"""

from __future__ import annotations

import torch

from engine.request import Proposal
from engine.sampler import Sampler
from engine.spec_decode.proposer import Observation, Proposer
from model.causal_lm import CausalLM
from model.dspark import Draft, DSpark, DSparkState
from model.parallel.modules import idle_step


class DSparkProposer(Proposer):
    def __init__(self, model: CausalLM, sampler: Sampler, num_tokens: int, min_confidence: float = 0.0):
        if not isinstance(model.mtp, DSpark):
            raise ValueError(
                "speculative method 'dspark' needs a checkpoint with DSpark stages (dspark_* keys)"
            )
        block = model.cfg.dspark.block_size
        if not 1 <= num_tokens <= block:
            raise ValueError(
                f"num_speculative_tokens={num_tokens} must be in [1, {block}] (dspark_block_size)"
            )
        if not 0.0 <= min_confidence < 1.0:
            raise ValueError(f"min_confidence={min_confidence} must be in [0, 1)")
        self.model, self.sampler, self.min_confidence = model, sampler, min_confidence
        self.inv_freq = model.rope(model.mtp[0].plan.rope)
        self.states: dict[str, DSparkState] = {}

    def release(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def forwards(self, observations: list[Observation]) -> int:
        """One pass through the stages when any request drafts (adding context keys runs no stage)."""
        return int(any(o.num_drafts for o in observations))

    @torch.no_grad()
    def idle(self) -> None:
        idle_step(self.model, self.model.mtp)

    @torch.no_grad()
    def propose(self, observations: list[Observation]) -> list[Proposal | None]:
        for o in observations:
            if o.start == 0 or o.request.id not in self.states:
                self.states[o.request.id] = self.model.mtp.new_state(self.inv_freq.device)
            if o.features.shape[0]:
                self.model.mtp.add_context(o.features, self.states[o.request.id], self.inv_freq)
        drafting = [o for o in observations if o.num_drafts]
        if not drafting:
            return [None] * len(observations)
        drafted: list[list[int]] = [[] for _ in drafting]

        def sample(i: int, logits: torch.Tensor) -> int:
            drafted[i].append(self.sampler.draft(drafting[i].request, logits, drafted[i]))
            return drafted[i][-1]

        model = self.model
        anchors = [o.next_ids[-1] for o in drafting]  # the token each step sampled
        states = [self.states[o.request.id] for o in drafting]
        drafts = model.mtp.propose(anchors, states, model.embed, model.head, self.inv_freq, sample)
        proposals = {id(o): self._cut(o, d) for o, d in zip(drafting, drafts, strict=True)}
        return [proposals.get(id(o)) for o in observations]

    def _cut(self, o: Observation, draft: Draft) -> Proposal | None:
        """The drafts to verify: at most the number asked for, while the confidence product holds."""
        survival = torch.cumprod(draft.confidence, 0)
        k = min(o.num_drafts, int((survival >= self.min_confidence).sum()))
        return Proposal(draft.tokens[:k], draft.logits[:k]) if k else None
