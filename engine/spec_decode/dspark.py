"""V4.1 DSpark proposer (model-spec §8.2): a block of drafts per request from the context keys of its
committed positions; the confidence head can shorten what is verified.

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
from model.deepseek_v41 import DeepseekV41
from model.dspark import DSparkState


class DSparkProposer(Proposer):
    def __init__(self, model: DeepseekV41, sampler: Sampler, num_tokens: int, min_confidence: float = 0.0):
        if not isinstance(model, DeepseekV41) or model.mtp is None:
            raise ValueError(
                "speculative method 'dspark' needs a DeepSeek V4.1 checkpoint with DSpark stages"
            )
        block = model.cfg.dspark_block_size
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

    @torch.no_grad()
    def propose(self, observations: list[Observation]) -> list[Proposal | None]:
        proposals = []
        for o in observations:
            if o.start == 0 or o.request.id not in self.states:
                self.states[o.request.id] = self.model.mtp.new_state(self.inv_freq.device)
            state = self.states[o.request.id]
            if o.features.shape[0]:
                self.model.mtp.add_context(o.features, state, self.inv_freq)
            proposals.append(self._draft(o, state) if o.num_drafts else None)
        return proposals

    def _draft(self, o: Observation, state: DSparkState) -> Proposal | None:
        request, drafted = o.request, []

        def sample(logits: torch.Tensor) -> int:
            drafted.append(self.sampler.draft(request, logits, drafted))
            return drafted[-1]

        model = self.model
        draft = model.mtp.propose(request.tokens[-1], state, model.embed, model.head, self.inv_freq, sample)
        survival = torch.cumprod(draft.confidence, 0)
        k = min(o.num_drafts, int((survival >= self.min_confidence).sum()))
        return Proposal(draft.tokens[:k], draft.logits[:k]) if k else None
