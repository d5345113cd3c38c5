"""The model configuration a checkpoint's ``config.json`` gives: its fields and what follows from them.
Reading one (``from_dict``, ``from_file``) translates the accepted spellings (``parse``) and checks every
cross-field contract (``validate``), naming the field, instead of failing at the first request."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from model.config.parse import parse
from model.config.sections import DSparkConfig, EngramConfig, Yarn, num_draft_layers


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: Yarn | None = None
    max_position_embeddings: int = 1048576
    num_key_value_heads: int = 1
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    num_hash_layers: int = 0
    swiglu_limit: float = 10.0
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    gate_temp: float = 1.0
    bos_token_id: int = 0
    eos_token_id: int = 1
    # V4.1 (model-spec §2, §4.7-4.9, §6, §8.2)
    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    engram: EngramConfig | None = None  # from the engram_* keys (model-spec §6)
    dspark: DSparkConfig | None = None  # from the dspark_* keys (model-spec §8.2)
    csa_ratio: int = 4  # V4 kinds by ratio, from transformers' compress_rates
    hca_ratio: int = 128
    quantization_config: dict[str, Any] | None = field(default=None, compare=False)

    @property
    def mix_width(self) -> int:
        """Width of an mHC projection: pre (n) + post (n) + comb (n*n)."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def is_v41(self) -> bool:
        return self.model_type == "deepseek_v41"

    @property
    def is_dspark(self) -> bool:
        """DSpark draft stages (V4.1, V4-Flash-0731, V4-Pro-0813): told by the ``dspark_*`` keys."""
        return self.dspark is not None

    @property
    def num_draft_layers(self) -> int:
        return num_draft_layers(self.dspark, self.num_nextn_predict_layers)

    def is_engram_layer(self, layer: int) -> bool:
        return self.engram is not None and layer in self.engram.layer_ids

    def is_dspark_target(self, layer: int) -> bool:
        return self.dspark is not None and layer in self.dspark.target_layer_ids

    @property
    def num_layers_with_draft(self) -> int:
        return self.num_hidden_layers + self.num_draft_layers

    def without_drafts(self) -> ModelConfig:
        """The backbone alone: for a checkpoint that ships no draft tensors (speculation unavailable)."""
        return replace(
            self,
            num_nextn_predict_layers=0,
            dspark=None,
            compress_ratios=self.compress_ratios[: self.num_hidden_layers],
        )

    @property
    def fp8_block(self) -> int | None:
        q = self.quantization_config
        return int(q["weight_block_size"][0]) if q else None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        return parse(raw, cls)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read model config {path}: {e}") from e
        return cls.from_dict(raw)
