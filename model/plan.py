"""The per-layer plan: what each layer is, derived once from the config.

Layers read their ``LayerPlan``; nothing else re-derives attention kinds, ratios, rope
variants or routing from the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from model.config import ModelConfig


class Attention(str, Enum):
    SLIDING = "sliding"  # window only
    CSA = "csa"  # window + ratio-4 overlapping compressor, entries picked by a lightning indexer
    HCA = "hca"  # window + ratio-128 compressor, every visible entry attended


class Rope(str, Enum):
    MAIN = "main"  # rope_theta, no YaRN: sliding-only layers, draft layers
    COMPRESS = "compress"  # compress_rope_theta with YaRN: every layer with a compressor


@dataclass(frozen=True)
class LayerPlan:
    index: int
    attention: Attention
    compress_ratio: int
    rope: Rope
    hash_moe: bool
    is_draft: bool

    @property
    def overlap(self) -> bool:
        """CSA compressors pool two overlapping windows (series Ca of group g-1 and Cb of g)."""
        return self.attention is Attention.CSA

    @property
    def has_indexer(self) -> bool:
        return self.attention is Attention.CSA


_KIND = {0: Attention.SLIDING, 4: Attention.CSA, 128: Attention.HCA}


def build_plan(cfg: ModelConfig) -> tuple[LayerPlan, ...]:
    """Plans for the backbone layers followed by the draft (``mtp.*``) layers."""
    plans = []
    for i in range(cfg.num_layers_with_draft):
        ratio = cfg.compress_ratios[i]
        is_draft = i >= cfg.num_hidden_layers
        plans.append(
            LayerPlan(
                index=i,
                attention=_KIND[ratio],
                compress_ratio=ratio,
                rope=Rope.MAIN if ratio == 0 else Rope.COMPRESS,
                hash_moe=not is_draft and i < cfg.num_hash_layers,
                is_draft=is_draft,
            )
        )
    return tuple(plans)
