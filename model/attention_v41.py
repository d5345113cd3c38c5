"""V4.1 CSA2 attention: Full / Reindex / Reuse layers over shared compressed KV (model-spec §4.7-4.9).

A Full layer compresses the attention input into latents, publishes the rotated latents as
compressed KV and ``k_norm(wk(latent))`` (rotated) as index keys, scores them and publishes its
top-k. A Reindex layer scores the latest published keys with its own queries; a Reuse layer
attends with the latest published top-k. Every layer also attends to its own window.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from model.attention import AttentionState, Positions, SharedKVAttention
from model.compressor import Compressor
from model.config import ModelConfig
from model.layers import RMSNorm, linear
from model.plan import Attention as Kind
from model.plan import Candidates, LayerPlan
from triton_kernels.rope import apply_rope


@dataclass
class Published:
    """What source layers publish to the layers above them during one forward call."""

    kv: dict[int, torch.Tensor] = field(default_factory=dict)  # KV source -> every entry [E, d]
    index_keys: dict[int, torch.Tensor] = field(default_factory=dict)  # KV source -> [E, d_I]
    topk: dict[int, torch.Tensor] = field(default_factory=dict)  # index source -> [S, k], -1 invalid
    candidates: torch.Tensor | None = None  # [S, E] bool: positions inside each query's kept blocks


class Indexer41(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: LayerPlan):
        super().__init__()
        self.cfg, self.plan = cfg, plan
        self.heads, self.dim = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = linear(cfg.q_lora_rank, self.heads * self.dim)
        self.weights_proj = linear(cfg.hidden_size, self.heads)
        if plan.attention is Kind.FULL:  # index keys are derived from this layer's latents
            self.wk = linear(cfg.head_dim, self.dim)
            self.k_norm = RMSNorm(self.dim, cfg.rms_norm_eps)

    def keys(self, latent: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        return apply_rope(self.k_norm(self.wk(latent)), positions, inv_freq)

    def scores(
        self, x: torch.Tensor, q_r: torch.Tensor, pos: Positions, inv_freq: torch.Tensor, keys: torch.Tensor
    ) -> torch.Tensor:
        """``S(t, j) = Σ_h w_h·ReLU(q_h·K_j)``, ``-inf`` where entry j is not visible: ``[S, E]``."""
        q = apply_rope(self.wq_b(q_r).view(-1, self.heads, self.dim), pos.values, inv_freq)
        weights = self.weights_proj(x).float() * (self.dim**-0.5 * self.heads**-0.5)
        logits = torch.relu(torch.einsum("shd,ed->she", q.float(), keys.float()))
        scores = (logits * weights[..., None]).sum(dim=1)
        hidden = (
            torch.arange(keys.shape[0], device=x.device)
            >= pos.visible_entries(self.plan.compress_ratio)[:, None]
        )
        return scores.masked_fill(hidden, float("-inf"))

    def select(self, scores: torch.Tensor, pos: Positions, published: Published) -> torch.Tensor:
        """Two-level top-k of one index source: ``[S, min(index_topk, E)]`` ascending, ``-1`` padded."""
        cfg = self.cfg
        if self.plan.candidates is Candidates.SOURCE:
            published.candidates = candidate_mask(
                scores, pos.visible_entries(self.plan.compress_ratio), cfg.candidate_block_size,
                cfg.candidate_topk_blocks,
            )  # fmt: skip
        elif self.plan.candidates is Candidates.CONSUMER:
            scores = scores.masked_fill(~published.candidates, float("-inf"))
        return top_k_positions(scores, cfg.index_topk)


def candidate_mask(scores: torch.Tensor, visible: torch.Tensor, block: int, keep: int) -> torch.Tensor:
    """Level one: per query, the positions of its ``keep`` best blocks (block score = max score).

    The block of the newest visible entry is always kept (it takes one of the slots); a block whose
    score is ``-inf`` never is.
    """
    seq, entries = scores.shape
    blocks = -(-entries // block)
    padded = scores.new_full((seq, blocks * block), float("-inf"))
    padded[:, :entries] = scores
    best = padded.view(seq, blocks, block).amax(dim=-1)
    newest = (visible - 1).div(block, rounding_mode="floor")
    has_newest = newest >= 0
    best[has_newest, newest[has_newest]] = float("inf")
    kept = best.topk(min(keep, blocks), dim=-1)
    chosen = torch.zeros(seq, blocks, dtype=torch.bool, device=scores.device)
    chosen.scatter_(1, kept.indices, kept.values > float("-inf"))
    return chosen.repeat_interleave(block, dim=1)[:, :entries]


def top_k_positions(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` best positions per row, ties to the lower index, ascending; ``-inf`` picks become -1."""
    k = min(k, scores.shape[1])
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    past_end = scores.shape[1]  # parks invalid picks after every real position while sorting
    ranked = order.masked_fill(scores.gather(1, order) == float("-inf"), past_end).sort(dim=-1).values
    return ranked.masked_fill(ranked == past_end, -1)


class V41Attention(SharedKVAttention):
    def __init__(self, cfg: ModelConfig, plan: LayerPlan):
        super().__init__(cfg, plan, head_norm=False)
        if plan.has_compressor:
            self.compressor = Compressor(
                cfg.hidden_size, self.head_dim, plan.compress_ratio, cfg.rms_norm_eps, ape=False
            )
        if plan.has_indexer:
            self.indexer = Indexer41(cfg, plan)

    def new_state(self, device: torch.device) -> AttentionState:
        state = AttentionState(window=torch.zeros(0, self.head_dim, device=device))
        if self.plan.has_compressor:
            state.compressor = self.compressor.new_state(device)
            state.index_keys = torch.zeros(0, self.indexer.dim, device=device)
        return state

    def forward(
        self,
        x: torch.Tensor,
        pos: Positions,
        inv_freq: torch.Tensor,
        state: AttentionState | None,
        published: Published,
    ) -> torch.Tensor:
        q_r, q, kv = self.project(x, pos, inv_freq)
        pools = [self.window_pool(kv, state)]
        plan = self.plan
        if plan.attention is Kind.SLIDING:
            return self.output(q, pools, pos, inv_freq)
        if plan.has_compressor:
            self._publish_entries(x, inv_freq, state, published)
        if plan.has_indexer:
            keys = published.index_keys[plan.kv_source]
            scores = self.indexer.scores(x, q_r, pos, inv_freq, keys)
            published.topk[plan.index] = self.indexer.select(scores, pos, published)
        pools.append((published.kv[plan.kv_source], published.topk[plan.index_source]))
        return self.output(q, pools, pos, inv_freq)

    def _publish_entries(
        self, x: torch.Tensor, inv_freq: torch.Tensor, state: AttentionState | None, published: Published
    ) -> None:
        """Compress ``x`` and publish every entry so far: rotated latents and their index keys."""
        latent, first = self.compressor.pool(x, state.compressor if state is not None else None)
        positions = (first + torch.arange(latent.shape[0], device=x.device)) * self.plan.compress_ratio
        entries = apply_rope(latent, positions, inv_freq)
        keys = self.indexer.keys(latent, positions, inv_freq)
        if state is not None:
            state.compressor.entries = entries = torch.cat([state.compressor.entries, entries])
            state.index_keys = keys = torch.cat([state.index_keys, keys])
        published.kv[self.plan.index], published.index_keys[self.plan.index] = entries, keys
