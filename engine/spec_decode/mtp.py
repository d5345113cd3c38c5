"""V4 MTP proposer (model-spec §8.1): the MTP block at position t reads the backbone streams at t and
token t+1 and predicts token t+2; fed its own output streams and draft, it chains further drafts.

Its window cache must hold, for every committed position, the key computed from the target's streams,
as if no token had ever been drafted. So after each step it first runs over every token the step
committed (a catch-up that also yields the first draft, at the last committed position), then chains
the further drafts at the following positions; those rows are speculative and the next catch-up
writes over them before any query can read them. They lie past the step's tokens: the scheduler
reserves ``lookahead`` positions for them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.request import Proposal
from engine.sampler import Sampler
from engine.spec_decode.proposer import Observation, Proposer
from model.cache import Batch, KVPools, SeqCache
from model.deepseek_v4 import DeepseekV4
from model.parallel.modules import idle_step


class MtpProposer(Proposer):
    def __init__(
        self,
        model: DeepseekV4,
        pools: KVPools,
        sampler: Sampler,
        num_tokens: int,
        share: Callable[[list[int]], list[int]] = list,
    ):
        """``share``: the drafts chained into the next forward as every rank must see them (rank 0's)."""
        if not isinstance(model, DeepseekV4) or model.cfg.is_dspark or not len(model.mtp):
            raise ValueError("speculative method 'mtp' needs a DeepSeek V4 checkpoint with an MTP layer")
        self.model, self.pools, self.sampler = model, pools, sampler
        self.layer = model.mtp[0]  # later drafts chain the same block
        self.inv_freq = model.rope(self.layer.plan.rope)
        self.lookahead, self.share = num_tokens, share

    def _predict(
        self, streams: torch.Tensor, next_ids: list[int], seqs: list[SeqCache], lengths: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.pools.device
        batch = Batch.build(self.pools, seqs, lengths, device)
        ids = torch.tensor(next_ids, device=device)
        return self.layer.predict(streams, ids, batch, self.inv_freq, self.model.embed, self.model.head)

    def forwards(self, observations: list[Observation]) -> int:
        """The catch-up, then one forward per further draft of the longest chain."""
        live = [o.num_drafts for o in observations if o.features.shape[0]]
        return max(1, *live) if live else 0

    @torch.no_grad()
    def idle(self) -> None:
        idle_step(self.model, self.layer)

    @torch.no_grad()
    def propose(self, observations: list[Observation]) -> list[Proposal | None]:
        live = [o for o in observations if o.features.shape[0]]
        if not live:
            return [None] * len(observations)
        lengths = [o.features.shape[0] for o in live]
        next_ids = [t for o in live for t in o.next_ids]
        # The catch-up reads the window through the committed tables, positioned at each chunk's start.
        views = [SeqCache(o.seq.tables, num_tokens=o.start) for o in live]
        logits, streams = self._predict(torch.cat([o.features for o in live]), next_ids, views, lengths)
        last = torch.tensor(lengths).cumsum(0) - 1
        active = [i for i, o in enumerate(live) if o.num_drafts]
        logits, streams = logits[last[active]], streams[last[active]]
        drafts: dict[int, list[int]] = {i: [] for i in active}
        rows: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        for step in range(max((live[i].num_drafts for i in active), default=0)):
            for i, row in zip(active, logits, strict=True):
                drafts[i].append(self.sampler.draft(live[i].request, row, drafts[i]))
                rows[i].append(row)
            keep = [j for j, i in enumerate(active) if live[i].num_drafts > step + 1]
            active = [active[j] for j in keep]
            if not active:
                break
            chained = self.share([drafts[i][-1] for i in active])  # under TP: rank 0's, on every rank
            views = [SeqCache(live[i].seq.tables, num_tokens=live[i].seq.num_tokens + step) for i in active]
            logits, streams = self._predict(streams[keep], chained, views, [1] * len(active))
        proposals = {id(live[i]): Proposal(d, torch.stack(rows[i])) for i, d in drafts.items()}
        return [proposals.get(id(o)) for o in observations]
