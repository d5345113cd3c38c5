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
from triton_kernels.indexer import (
    IndexQueries,
    KeyPool,
    indexer_topk,
    indexer_topk_and_candidates,
    indexer_topk_in_candidates,
)
from triton_kernels.rope import apply_rope


@dataclass
class Published:
    """What source layers publish to the layers above them during one forward call."""

    kv: dict[int, torch.Tensor] = field(default_factory=dict)  # KV source -> every entry [E, d]
    index_keys: dict[int, torch.Tensor] = field(default_factory=dict)  # KV source -> [E, d_I]
    topk: dict[int, torch.Tensor] = field(default_factory=dict)  # index source -> [S, k], -1 invalid
    candidates: torch.Tensor | None = None  # [S, candidate_topk_blocks] kept block ids, -1 padded


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

    def queries(
        self, x: torch.Tensor, q_r: torch.Tensor, pos: Positions, inv_freq: torch.Tensor
    ) -> IndexQueries:
        """This layer's indexer queries for one request (the score's scales folded into the weights)."""
        q = apply_rope(self.wq_b(q_r).view(-1, self.heads, self.dim), pos.values, inv_freq)
        weights = self.weights_proj(x).float() * (self.dim * self.heads) ** -0.5
        request = torch.zeros(q.shape[0], dtype=torch.int32, device=x.device)
        return IndexQueries(
            q, weights, request, pos.visible_entries(self.plan.compress_ratio).to(torch.int32)
        )

    def select(self, queries: IndexQueries, keys: torch.Tensor, published: Published) -> torch.Tensor:
        """Top-k of one index source, two-level where planned: ``[S, min(index_topk, E)]``, ascending."""
        cfg, pool = self.cfg, KeyPool.dense(keys)
        k = min(cfg.index_topk, pool.capacity)
        if self.plan.candidates is Candidates.SOURCE:
            picked, published.candidates = indexer_topk_and_candidates(
                queries, pool, k, cfg.candidate_block_size, cfg.candidate_topk_blocks
            )
            return picked
        if self.plan.candidates is Candidates.CONSUMER:
            return indexer_topk_in_candidates(
                queries, pool, k, published.candidates, cfg.candidate_block_size
            )
        return indexer_topk(queries, pool, k)


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
            queries = self.indexer.queries(x, q_r, pos, inv_freq)
            published.topk[plan.index] = self.indexer.select(
                queries, published.index_keys[plan.kv_source], published
            )
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
