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

from model.attention import SharedKVAttention, index_queries
from model.cache import Batch
from model.compressor import Compressor
from model.config import ModelConfig
from model.layers import RMSNorm, linear
from model.plan import Attention as Kind
from model.plan import Candidates, LayerPlan
from triton_kernels.custom_ops import (
    apply_rope,
    indexer_topk,
    indexer_topk_and_candidates,
    indexer_topk_in_candidates,
)
from triton_kernels.indexer import IndexQueries, KeyPool


@dataclass
class Published:
    """What index sources publish to the layers above them during one call (KV sources publish
    through their pools, which every layer reads by slot)."""

    topk: dict[int, torch.Tensor] = field(default_factory=dict)  # index source -> [T, k] entry numbers, -1
    candidates: torch.Tensor | None = None  # [T, candidate_topk_blocks] kept block ids, -1 padded


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
        # The compressor's latents are fp32 whatever the compute dtype.
        return self.k_norm.rotated(self.wk(latent.to(self.wk.weight.dtype)), positions, inv_freq)

    def queries(
        self, x: torch.Tensor, q_r: torch.Tensor, batch: Batch, inv_freq: torch.Tensor
    ) -> IndexQueries:
        """This layer's indexer queries (the score's scales folded into the weights)."""
        q = apply_rope(self.wq_b(q_r).view(-1, self.heads, self.dim), batch.positions, inv_freq)
        weights = self.weights_proj(x).float() * (self.dim * self.heads) ** -0.5
        visible = batch.visible(self.plan.compress_ratio).to(torch.int32)
        return index_queries(q, weights, batch.request, visible, self.key_pool(batch))

    def key_pool(self, batch: Batch) -> KeyPool:
        return batch.key_pool(self.plan.kv_source, self.plan.compress_ratio)

    def select(self, queries: IndexQueries, batch: Batch, published: Published) -> torch.Tensor:
        """Top-k entry numbers of one index source, two-level where planned: ``[T, k]``, ascending."""
        cfg, plan = self.cfg, self.plan
        pool = self.key_pool(batch)
        k = min(cfg.index_topk, batch.max_entries(plan.compress_ratio))
        if plan.candidates is Candidates.SOURCE:
            picked, published.candidates = indexer_topk_and_candidates(
                queries, pool, k, cfg.candidate_block_size, cfg.candidate_topk_blocks
            )
            return picked
        if plan.candidates is Candidates.CONSUMER:
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

    def forward(
        self, x: torch.Tensor, batch: Batch, inv_freq: torch.Tensor, published: Published
    ) -> torch.Tensor:
        plan = self.plan
        q_r, q, window = self.project_window(x, batch, inv_freq)
        pools = [window]
        if plan.attention is Kind.SLIDING:
            return self.output(q, pools, batch.positions, inv_freq)
        if plan.has_compressor:
            self._publish_entries(x, batch, inv_freq)
        if plan.has_indexer:
            queries = self.indexer.queries(x, q_r, batch, inv_freq)
            published.topk[plan.index] = self.indexer.select(queries, batch, published)
        numbers = published.topk[plan.index_source]
        pools.append(
            batch.pools.entries[plan.kv_source].attended(batch.entry_slots(plan.compress_ratio, numbers))
        )
        return self.output(q, pools, batch.positions, inv_freq)

    def _publish_entries(self, x: torch.Tensor, batch: Batch, inv_freq: torch.Tensor) -> None:
        """Compress ``x`` and store each new entry: the rotated latent and its index key."""
        plan, ratio = self.plan, self.plan.compress_ratio
        latent, request, numbers = self.compressor.pool_step(x, batch, "compressors", plan.index)
        positions = numbers * ratio
        entries = apply_rope(latent, positions, inv_freq)
        batch.store(batch.pools.entries[plan.index], ratio, request, numbers, entries)
        keys = self.indexer.keys(latent, positions, inv_freq)
        batch.store(batch.pools.index_keys[plan.index], ratio, request, numbers, keys)
