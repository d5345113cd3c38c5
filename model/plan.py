"""The per-layer plan: what each layer is, derived once from the config.

Layers read their ``LayerPlan``; nothing else re-derives attention kinds, ratios, rope
variants, KV/index sources, candidate roles or routing from the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from model.config import ModelConfig


class Attention(str, Enum):
    SLIDING = "sliding"  # window only
    CSA = "csa"  # V4: window + ratio-4 overlapping compressor, entries picked by a lightning indexer
    HCA = "hca"  # V4: window + ratio-128 compressor, every visible entry attended
    FULL = "full"  # V4.1 CSA2: compresses and publishes KV and index keys, scores and publishes top-k
    REINDEX = "reindex"  # V4.1 CSA2: reads published KV and index keys, scores and publishes top-k
    REUSE = "reuse"  # V4.1 CSA2: reads published KV and top-k


class Rope(str, Enum):
    MAIN = "main"  # rope_theta, no YaRN: sliding-only layers, draft layers
    COMPRESS = "compress"  # compress_rope_theta with YaRN: every layer with compressed KV


class Candidates(str, Enum):
    """Role in the V4.1 two-level TopK."""

    NONE = "none"
    SOURCE = "source"  # publishes the candidate blocks of every query; its own top-k is unrestricted
    CONSUMER = "consumer"  # an index source above the candidate source: scores only inside candidates


@dataclass(frozen=True)
class LayerPlan:
    index: int
    attention: Attention
    compress_ratio: int
    rope: Rope
    hash_moe: bool
    is_draft: bool
    n_experts: int
    top_k: int
    kv_source: int | None = None  # V4.1: layer whose compressed KV and index keys this layer reads
    index_source: int | None = None  # V4.1: layer whose top-k indices this layer reads
    candidates: Candidates = Candidates.NONE
    engram: bool = False  # V4.1: Engram injects into the streams before this layer

    @property
    def overlap(self) -> bool:
        """V4 CSA compressors pool two overlapping windows (series Ca of group g-1 and Cb of g)."""
        return self.attention is Attention.CSA

    @property
    def has_indexer(self) -> bool:
        return self.attention in (Attention.CSA, Attention.FULL, Attention.REINDEX)

    @property
    def has_compressor(self) -> bool:
        return self.attention in (Attention.CSA, Attention.HCA, Attention.FULL)


def build_plan(cfg: ModelConfig) -> tuple[LayerPlan, ...]:
    """Plans for the backbone layers followed by the draft (``mtp.*``) layers."""
    return tuple(
        _v41_layer(cfg, i) if cfg.is_v41 else _v4_layer(cfg, i) for i in range(cfg.num_layers_with_draft)
    )


def _experts(cfg: ModelConfig, is_draft: bool) -> tuple[int, int]:
    """Routed experts and top-k: DSpark stages may have their own (absent: the backbone's)."""
    if is_draft and cfg.is_dspark:
        return (
            cfg.dspark.n_routed_experts or cfg.n_routed_experts,
            cfg.dspark.num_experts_per_tok or cfg.num_experts_per_tok,
        )
    return cfg.n_routed_experts, cfg.num_experts_per_tok


def _v4_layer(cfg: ModelConfig, i: int) -> LayerPlan:
    ratio, is_draft = cfg.compress_ratios[i], i >= cfg.num_hidden_layers
    kinds = {0: Attention.SLIDING, cfg.csa_ratio: Attention.CSA, cfg.hca_ratio: Attention.HCA}
    experts, top_k = _experts(cfg, is_draft)
    return LayerPlan(
        index=i,
        attention=kinds[ratio],
        compress_ratio=ratio,
        rope=Rope.MAIN if ratio == 0 else Rope.COMPRESS,
        hash_moe=not is_draft and i < cfg.num_hash_layers,
        is_draft=is_draft,
        n_experts=experts,
        top_k=top_k,
    )


def _v41_layer(cfg: ModelConfig, i: int) -> LayerPlan:
    ratio, is_draft = cfg.compress_ratios[i], i >= cfg.num_hidden_layers
    experts, top_k = _experts(cfg, is_draft)
    plan = dict(
        index=i,
        attention=Attention.SLIDING,
        compress_ratio=ratio,
        rope=Rope.MAIN if ratio == 0 else Rope.COMPRESS,
        hash_moe=False,
        is_draft=is_draft,
        n_experts=experts,
        top_k=top_k,
        engram=cfg.is_engram_layer(i),
    )
    if ratio == 0 or is_draft:
        return LayerPlan(**plan)
    kv_source = max(s for s in cfg.kv_source_layer_ids if s <= i)
    index_source = max(s for s in cfg.index_source_layer_ids if s <= i)
    if i in cfg.kv_source_layer_ids:
        kind = Attention.FULL
    elif i in cfg.index_source_layer_ids:
        kind = Attention.REINDEX
    else:
        kind = Attention.REUSE
    candidates = Candidates.NONE
    if i == cfg.candidate_source_layer_id:
        candidates = Candidates.SOURCE
    elif kind is not Attention.REUSE and 0 <= cfg.candidate_source_layer_id < i:
        candidates = Candidates.CONSUMER
    plan.update(attention=kind, kv_source=kv_source, index_source=index_source, candidates=candidates)
    return LayerPlan(**plan)
