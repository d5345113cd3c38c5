"""V4 attention: shared-KV MQA over a sliding window plus compressed entries, with sink.

Every layer attends to its own window keys; CSA layers add the compressed entries picked by
their lightning indexer, HCA layers every visible compressed entry (model-spec §4). The core
attention takes index tensors (``-1`` = invalid) into KV pools, the contract of the sparse
attention kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from model.compressor import Compressor, CompressorState
from model.config import ModelConfig
from model.layers import RMSNorm, linear
from model.plan import LayerPlan
from triton_kernels.indexer import IndexQueries, KeyPool, indexer_logits, indexer_topk
from triton_kernels.quant import quantize_int8
from triton_kernels.rmsnorm import rms_norm
from triton_kernels.rope import apply_rope
from triton_kernels.sparse_attn import KVPool, sparse_attention


@dataclass
class AttentionState:
    """Per-request state of one layer across calls."""

    window: torch.Tensor  # [<= W-1, d]: keys of the latest positions, oldest first
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None  # V4 CSA: the indexer's own compressor
    index_keys: torch.Tensor | None = None  # V4.1 Full: index keys of every entry so far, [E, d_I]


@dataclass(frozen=True)
class Positions:
    """Positions of the tokens of one call; ``start`` is the count of earlier tokens."""

    start: int
    values: torch.Tensor  # [S] int64, start .. start+S-1

    def visible_entries(self, ratio: int) -> torch.Tensor:
        """Compressed entry g is visible at position t iff g < floor((t+1)/ratio)."""
        return (self.values + 1) // ratio


class Indexer(nn.Module):
    """Lightning indexer of a CSA layer: its own compressor over ``x`` and a ReLU-weighted scorer.

    ``int8`` switches to the Ascend format (model-spec §9.4): queries and keys quantised per row,
    int32 dot products. It is off by default: the float path is the one checked against transformers.
    """

    def __init__(self, cfg: ModelConfig, plan: LayerPlan):
        super().__init__()
        self.heads, self.dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = linear(cfg.q_lora_rank, self.heads * self.dim)
        self.weights_proj = linear(cfg.hidden_size, self.heads)
        self.compressor = Compressor(
            cfg.hidden_size, self.dim, plan.compress_ratio, cfg.rms_norm_eps, overlap=True
        )
        self.int8 = False

    def _operands(
        self,
        x: torch.Tensor,
        q_r: torch.Tensor,
        pos: Positions,
        inv_freq: torch.Tensor,
        state: CompressorState | None,
    ) -> tuple[IndexQueries, KeyPool]:
        """The call's queries, one request, against its entries ``[E, d_I]`` as a pool (entry j = slot j)."""
        keys = self.compressor(x, inv_freq, state)
        q = apply_rope(self.wq_b(q_r).view(-1, self.heads, self.dim), pos.values, inv_freq)
        # The score's d_I^-1/2 and the weights' H^-1/2 are both folded into the head weights.
        weights = self.weights_proj(x).float() * (self.heads * self.dim) ** -0.5
        request = torch.zeros(q.shape[0], dtype=torch.int32, device=x.device)
        visible = pos.visible_entries(self.compressor.ratio).to(torch.int32)
        if self.int8:
            (q, q_scale), (keys, k_scale) = quantize_int8(q), quantize_int8(keys)
            return IndexQueries(q, weights, request, visible, q_scale), KeyPool.dense(keys, k_scale)
        return IndexQueries(q, weights, request, visible), KeyPool.dense(keys)

    def scores(
        self,
        x: torch.Tensor,
        q_r: torch.Tensor,
        pos: Positions,
        inv_freq: torch.Tensor,
        state: CompressorState | None,
    ) -> torch.Tensor:
        """``S(t, j) = Σ_h w_h·ReLU(q_h·K_j)``, ``-inf`` where entry j is not visible: ``[S, E]``."""
        return indexer_logits(*self._operands(x, q_r, pos, inv_freq, state))

    def forward(
        self,
        x: torch.Tensor,
        q_r: torch.Tensor,
        pos: Positions,
        inv_freq: torch.Tensor,
        state: CompressorState | None,
    ) -> torch.Tensor:
        """Indices of the top-k visible entries per query (ascending), ``-1`` if unreachable: ``[S, k]``."""
        queries, pool = self._operands(x, q_r, pos, inv_freq, state)
        return indexer_topk(queries, pool, min(self.topk, pool.capacity))


class SharedKVAttention(nn.Module):
    """What every V4 / V4.1 attention layer has: the query and shared K=V projections, the sliding
    window, sink attention over gathered keys, inverse RoPE and the grouped output projection."""

    def __init__(self, cfg: ModelConfig, plan: LayerPlan, head_norm: bool):
        super().__init__()
        self.plan, self.head_norm = plan, head_norm
        self.heads, self.head_dim, self.groups = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
        self.window, self.eps = cfg.sliding_window, cfg.rms_norm_eps
        self.wq_a = linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = linear(cfg.q_lora_rank, self.heads * self.head_dim)
        self.wkv = linear(cfg.hidden_size, self.head_dim)
        self.kv_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.wo_a = linear(self.heads * self.head_dim // self.groups, self.groups * cfg.o_lora_rank)
        self.wo_b = linear(self.groups * cfg.o_lora_rank, cfg.hidden_size)
        self.attn_sink = nn.Parameter(torch.empty(self.heads))

    def project(
        self, x: torch.Tensor, pos: Positions, inv_freq: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q_r [S, q_r]`` (also the indexer's input), rotated queries ``[S, H, d]`` and keys ``[S, d]``."""
        q_r = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_r).view(x.shape[0], self.heads, self.head_dim)
        if self.head_norm:
            q = rms_norm(q, None, self.eps)
        q = apply_rope(q, pos.values, inv_freq)
        return q_r, q, apply_rope(self.kv_norm(self.wkv(x)), pos.values, inv_freq)

    def window_pool(
        self, kv: torch.Tensor, state: AttentionState | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool of earlier window keys plus ``kv``, and each query's W newest positions in it."""
        past = state.window if state is not None else kv.new_zeros(0, self.head_dim)
        pool = torch.cat([past, kv])
        if state is not None:
            state.window = pool[max(0, pool.shape[0] - (self.window - 1)) :]
        offsets = past.shape[0] + torch.arange(kv.shape[0], device=kv.device)[:, None]
        offsets = offsets - torch.arange(self.window, device=kv.device)
        return pool, offsets.masked_fill(offsets < 0, -1)

    def output(
        self,
        q: torch.Tensor,
        pools: list[tuple[torch.Tensor, torch.Tensor]],
        pos: Positions,
        inv_freq: torch.Tensor,
    ) -> torch.Tensor:
        # Values carry rope: the output is de-rotated at the query position (fused into the op).
        kv_pools = [KVPool(kv, idx) for kv, idx in pools]
        scale = self.head_dim**-0.5
        out, _ = sparse_attention(q, kv_pools, self.attn_sink.float(), scale, pos.values, inv_freq)
        # Group g of H/G heads is projected by row block g of wo_a only.
        grouped = out.reshape(out.shape[0], self.groups, -1)
        weight = self.wo_a.weight.view(self.groups, -1, grouped.shape[-1])
        return self.wo_b(torch.einsum("tgi,goi->tgo", grouped, weight).flatten(1))


class V4Attention(SharedKVAttention):
    def __init__(self, cfg: ModelConfig, plan: LayerPlan):
        super().__init__(cfg, plan, head_norm=True)
        if plan.has_compressor:
            self.compressor = Compressor(
                cfg.hidden_size, self.head_dim, plan.compress_ratio, cfg.rms_norm_eps, overlap=plan.overlap
            )
        if plan.has_indexer:
            self.indexer = Indexer(cfg, plan)

    def new_state(self, device: torch.device) -> AttentionState:
        state = AttentionState(window=torch.zeros(0, self.head_dim, device=device))
        if self.plan.has_compressor:
            state.compressor = self.compressor.new_state(device)
        if self.plan.has_indexer:
            state.indexer = self.indexer.compressor.new_state(device)
        return state

    def forward(
        self, x: torch.Tensor, pos: Positions, inv_freq: torch.Tensor, state: AttentionState | None
    ) -> torch.Tensor:
        q_r, q, kv = self.project(x, pos, inv_freq)
        pools = [self.window_pool(kv, state)]
        if self.plan.has_compressor:
            entries = self.compressor(x, inv_freq, state.compressor if state is not None else None)
            if self.plan.has_indexer:
                picked = self.indexer(x, q_r, pos, inv_freq, state.indexer if state is not None else None)
            else:
                picked = torch.arange(entries.shape[0], device=x.device).expand(x.shape[0], -1)
                picked = picked.masked_fill(
                    picked >= pos.visible_entries(self.plan.compress_ratio)[:, None], -1
                )
            pools.append((entries, picked))
        return self.output(q, pools, pos, inv_freq)
