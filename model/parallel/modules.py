"""The modules a rank's share of the model runs in place of the whole ones: the vocabulary-split
embedding, a rank's routed experts, the expert-parallel MoE block (tensor parallel, stage A) and the
all-to-all dispatching one (data parallel, stage B), and ``idle_step``, which keeps an idle
data-parallel rank in its peers' collectives."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from model.moe import Expert, Gate
from model.parallel.context import ParallelContext
from model.quant_linear import BIAS_COLUMNS, StackedExperts


class VocabParallelEmbedding(nn.Embedding):
    """Rows ``[start, stop)`` of the vocabulary; ids elsewhere look up zeros, and the sum over ranks is the
    plain lookup exactly (one nonzero term per token)."""

    def __init__(self, start: int, stop: int, dim: int, context: ParallelContext):
        super().__init__(stop - start, dim)
        self.start, self.context = start, context

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(torch.where(mine, local, 0), self.weight) * mine.unsqueeze(-1)
        return self.context.all_reduce(out.float()).to(out.dtype)  # fp32 on the wire: any backend sums it


class LocalExperts(StackedExperts):
    """The routed experts ``[first, first + count)`` of a layer, stacked in their stored format and named
    as the checkpoint names them; choices of other experts are shifted outside ``[0, count)``, so
    ``moe_gemm`` sorts them after the last expert and never computes them."""

    def __init__(self, first: int, count: int, shape: tuple, *args: object):
        _, hidden, inter, limit = shape
        super().__init__(count, hidden, inter, limit, *args)
        self.first, self.shape = first, shape

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        local: dict[str, torch.Tensor] = {}
        super()._save_to_state_dict(local, "", keep_vars)
        for name, t in local.items():
            e, _, rest = name.partition(".")
            destination[f"{prefix}{int(e) + self.first}.{rest}"] = t

    def forward(
        self, x: torch.Tensor, picked: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None = None
    ) -> torch.Tensor:
        return super().forward(x, picked - self.first, weights, shared)

    def pack(self, fmt: str, block: int = 1, bias_columns: tuple[int, ...] = BIAS_COLUMNS) -> LocalExperts:
        return LocalExperts(self.first, self.dims[0], self.shape, fmt, block, bias_columns)


class ExpertParallelMoE(nn.Module):
    """A MoE block's share on one rank: the replicated gate, the routed experts ``[start, stop)`` (a token
    is computed here only for the experts of this rank it is routed to) and a slice of the shared
    expert's intermediate width; the partial sums of both are all-reduced once."""

    def __init__(
        self, gate: Gate, experts: range, shared: Expert | None, shape: tuple, context: ParallelContext
    ):
        """``shape``: the block's ``MoE.shape``, (experts, hidden, intermediate, clamp limit)."""
        super().__init__()
        self.gate, self.context = gate, context
        self.experts = LocalExperts(experts.start, len(experts), shape)
        self.shared_experts = shared

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        picked, weights = self.gate(x, ids)
        shared = None if self.shared_experts is None else self.shared_experts(x)
        return self.context.all_reduce(self.experts(x, picked, weights, shared)).to(x.dtype)


class DispatchMoE(ExpertParallelMoE):
    """Stage B's MoE block: each data-parallel rank routes its own tokens with the replicated gate, sends
    every (token, expert) choice to the rank owning the expert (all-to-all: the counts first, then the
    rows), computes the choices it received with its ``LocalExperts`` and sends the weighted results back
    (all-to-all), where each token sums its ``k`` results in slot order, as one process does. A rank with
    no tokens still takes part with empty rows, so every rank runs the same collectives."""

    def __init__(self, *args: object):
        """As ``ExpertParallelMoE``, with the whole shared expert."""
        super().__init__(*args)
        self.per_rank = self.experts.w1.shape[0]
        self.pairs_computed = 0  # (token, expert) choices this rank's experts computed, for the checks

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        picked, weights = self.gate(x, ids)
        t, k = picked.shape
        owner = (picked // self.per_rank).reshape(-1)
        order = torch.argsort(owner, stable=True)
        sent = torch.bincount(owner, minlength=self.context.world)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=self.context.group)
        sent_sizes, received_sizes = sent.tolist(), received.tolist()  # the payload's split sizes
        # One fp32 row per choice: the token's hidden state, its expert and its routing weight (exact).
        rows = torch.cat([x.float()[order // k], picked.reshape(-1, 1)[order].float(),
                          weights.reshape(-1, 1)[order]], dim=1)  # fmt: skip
        inbox = rows.new_empty(sum(received_sizes), rows.shape[1])
        dist.all_to_all_single(inbox, rows, received_sizes, sent_sizes, group=self.context.group)
        self.pairs_computed += inbox.shape[0]
        hidden = inbox[:, :-2].to(x.dtype)
        results = self.experts(hidden, inbox[:, -2:-1].long(), inbox[:, -1:]).float()
        back = results.new_empty(t * k, x.shape[1])
        dist.all_to_all_single(back, results, sent_sizes, received_sizes, group=self.context.group)
        out = torch.empty_like(back)
        out[order] = back
        out = out.view(t, k, x.shape[1]).sum(1)
        if self.shared_experts is not None:
            out += self.shared_experts(x).float()
        return out.to(x.dtype)


def idle_step(model: nn.Module, layers: nn.Module | None = None) -> None:
    """A data-parallel rank with nothing scheduled: the MoE blocks of one forward through ``layers`` (the
    backbone's by default, or a draft head's) dispatch zero tokens, in forward order, so the other ranks'
    all-to-alls find it (the collectives are the only thing that must match)."""
    weight = model.embed.weight
    empty = torch.empty(0, model.cfg.hidden_size, dtype=weight.dtype, device=weight.device)
    ids = torch.empty(0, dtype=torch.long, device=weight.device)
    for module in (model.layers if layers is None else layers).modules():
        if isinstance(module, DispatchMoE):
            module(empty, ids)
