"""V4 attention: shared-KV MQA over a sliding window plus compressed entries, with sink.

Every layer attends to its own window keys; CSA layers add the compressed entries picked by
their lightning indexer, HCA layers every visible compressed entry (model-spec §4). Keys and
entries live in the paged pools of ``model.cache``: each layer writes its new rows at their slots
and hands the sparse attention kernel global slot indices (``-1`` = invalid).
"""

from __future__ import annotations

import torch
from torch import nn

from model.cache import Batch
from model.compressor import Compressor
from model.config import ModelConfig
from model.layers import RMSNorm, linear
from model.plan import LayerPlan
from model.quant_linear import StackedRows, stack_rows
from triton_kernels.custom_ops import (
    apply_rope,
    indexer_logits,
    indexer_topk,
    quantize_int8,
    sparse_attention,
)
from triton_kernels.indexer import IndexQueries, KeyPool
from triton_kernels.sparse_attn import KVPool


def index_queries(
    q: torch.Tensor, weights: torch.Tensor, request: torch.Tensor, visible: torch.Tensor, pool: KeyPool
) -> IndexQueries:
    """The indexer's queries in the keys' format: int8 per (token, head) for int8 keys."""
    if pool.scale is None:
        return IndexQueries(q, weights, request, visible)
    codes, scale = quantize_int8(q)
    return IndexQueries(codes, weights, request, visible, scale)


class Indexer(nn.Module):
    """Lightning indexer of a CSA layer: its own compressor over ``x`` and a ReLU-weighted scorer.

    In a quantised cache its keys are int8 with a scale per entry (model-spec §9.4): the queries are then
    quantised per (token, head) and the dots are int8 x int8 -> int32 (``index_queries``).
    """

    def __init__(self, cfg: ModelConfig, plan: LayerPlan):
        super().__init__()
        self.plan = plan
        self.heads, self.dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = linear(cfg.q_lora_rank, self.heads * self.dim)
        self.weights_proj = linear(cfg.hidden_size, self.heads)
        self.compressor = Compressor(
            cfg.hidden_size, self.dim, plan.compress_ratio, cfg.rms_norm_eps, overlap=True
        )

    def compress(self, x: torch.Tensor, batch: Batch, inv_freq: torch.Tensor) -> None:
        """Store the index keys of the groups ``x`` closes in the layer's key pool."""
        layer = self.plan.index
        keys, request, numbers = self.compressor.pool_step(x, batch, "indexers", layer, inv_freq)
        batch.store(batch.pools.index_keys[layer], self.plan.compress_ratio, request, numbers, keys)

    def _operands(
        self, x: torch.Tensor, q_r: torch.Tensor, batch: Batch, inv_freq: torch.Tensor
    ) -> tuple[IndexQueries, KeyPool]:
        q = apply_rope(self.wq_b(q_r).view(-1, self.heads, self.dim), batch.positions, inv_freq)
        # The score's d_I^-1/2 and the weights' H^-1/2 are both folded into the head weights.
        weights = self.weights_proj(x).float() * (self.heads * self.dim) ** -0.5
        visible = batch.visible(self.plan.compress_ratio).to(torch.int32)
        pool = batch.key_pool(self.plan.index, self.plan.compress_ratio)
        return index_queries(q, weights, batch.request, visible, pool), pool

    def scores(
        self, x: torch.Tensor, q_r: torch.Tensor, batch: Batch, inv_freq: torch.Tensor
    ) -> torch.Tensor:
        """``S(t, j) = Σ_h w_h·ReLU(q_h·K_j)`` over entry numbers j, ``-inf`` if not visible: ``[T, E]``."""
        return indexer_logits(*self._operands(x, q_r, batch, inv_freq))

    def forward(
        self, x: torch.Tensor, q_r: torch.Tensor, batch: Batch, inv_freq: torch.Tensor
    ) -> torch.Tensor:
        """Entry numbers of each token's top-k visible entries, ascending, -1 if unreachable: ``[T, k]``."""
        queries, pool = self._operands(x, q_r, batch, inv_freq)
        return indexer_topk(queries, pool, min(self.topk, batch.max_entries(self.plan.compress_ratio)))


class SharedKVAttention(nn.Module):
    """What every V4 / V4.1 attention layer has: the query and shared K=V projections, the sliding
    window, sink attention over gathered keys, inverse RoPE and the grouped output projection."""

    def __init__(self, cfg: ModelConfig, plan: LayerPlan, head_norm: bool):
        super().__init__()
        self.plan, self.head_norm = plan, head_norm
        self.heads, self.head_dim, self.groups = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
        self.eps = cfg.rms_norm_eps
        self.wq_a = linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = linear(cfg.q_lora_rank, self.heads * self.head_dim)
        self.wkv = linear(cfg.hidden_size, self.head_dim)
        self.q_kv: StackedRows | None = None
        self.kv_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.wo_a = linear(self.heads * self.head_dim // self.groups, self.groups * cfg.o_lora_rank)
        self.wo_b = linear(self.groups * cfg.o_lora_rank, cfg.hidden_size)
        self.attn_sink = nn.Parameter(torch.empty(self.heads))

    def project(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        store: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q_r [T, q_r]`` (also the indexer's input), rotated queries ``[T, H, d]`` and keys ``[T, d]``
        (also stored into ``store``, a cache pool and slots, by the same op)."""
        q_a, kv = (self.wq_a(x), self.wkv(x)) if self.q_kv is None else self.q_kv(x)
        q_r = self.q_norm(q_a)
        q = self.wq_b(q_r).view(x.shape[0], self.heads, self.head_dim)
        q = apply_rope(q, positions, inv_freq, norm_eps=self.eps if self.head_norm else None)
        return q_r, q, self.kv_norm.rotated(kv, positions, inv_freq, store)

    def stack_projections(self) -> None:
        """``wq_a`` and ``wkv`` (both of ``x``) as one GEMM (before the weights load into its rows)."""
        self.q_kv = stack_rows(self.wq_a, self.wkv)

    def project_window(
        self, x: torch.Tensor, batch: Batch, inv_freq: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, KVPool]:
        """``project``, the keys stored as the tokens' window keys (by the rotation itself unless the cache
        quantises them); the window pool each token reads, the W newest positions of its request."""
        pool = batch.pools.window[self.plan.index]
        plain = pool.scale is None
        store = (pool.data, batch.window_write) if plain else None
        q_r, q, kv = self.project(x, batch.positions, inv_freq, store)
        if not plain:
            batch.write(pool, batch.window_write, kv)
        return q_r, q, pool.attended(batch.window_read)

    def output(
        self, q: torch.Tensor, pools: list[KVPool], positions: torch.Tensor, inv_freq: torch.Tensor
    ) -> torch.Tensor:
        # Values carry rope: the output is de-rotated at the query position (fused into the op).
        sink, scale = self.attn_sink.float(), self.head_dim**-0.5
        out, _ = sparse_attention(q, pools, sink, scale, positions, inv_freq)
        # Group g of H/G heads is projected by row block g of wo_a only.
        grouped = out.reshape(out.shape[0], self.groups, -1)
        return self.wo_b(self.wo_a.grouped(grouped).flatten(1))


class V4Attention(SharedKVAttention):
    def __init__(self, cfg: ModelConfig, plan: LayerPlan):
        super().__init__(cfg, plan, head_norm=True)
        if plan.has_compressor:
            self.compressor = Compressor(
                cfg.hidden_size, self.head_dim, plan.compress_ratio, cfg.rms_norm_eps, overlap=plan.overlap
            )
        if plan.has_indexer:
            self.indexer = Indexer(cfg, plan)

    def forward(self, x: torch.Tensor, batch: Batch, inv_freq: torch.Tensor) -> torch.Tensor:
        plan = self.plan
        q_r, q, window = self.project_window(x, batch, inv_freq)
        pools = [window]
        if plan.has_compressor:
            pool, ratio = batch.pools.entries[plan.index], plan.compress_ratio
            entries, request, numbers = self.compressor.pool_step(
                x, batch, "compressors", plan.index, inv_freq
            )
            batch.store(pool, ratio, request, numbers, entries)
            if plan.has_indexer:
                self.indexer.compress(x, batch, inv_freq)
                numbers = self.indexer(x, q_r, batch, inv_freq)
            else:  # HCA: every visible entry
                numbers = batch.every_visible_entry(ratio)
            pools.append(pool.attended(batch.entry_slots(ratio, numbers)))
        return self.output(q, pools, batch.positions, inv_freq)
