"""Model configuration parsed from a checkpoint's ``config.json`` and validated at load.

Accepts the Hugging Face naming (``deepseek_v4``, optionally wrapped in ``text_config``), the
legacy fields of the official release (``compress_ratios``, ``num_hash_layers``,
``qk_rope_head_dim``) and the official ``inference/config.json`` names (``dim``, ``n_layers``...).
Every cross-field contract fails here, naming the field, instead of at the first request.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from model.engram import EngramConfig
from triton_kernels import indexer, topk
from triton_kernels.rope import Yarn

# Names used by the official ``inference/config.json`` -> our (Hugging Face) names.
_OFFICIAL_NAMES = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "moe_inter_dim": "moe_intermediate_size",
    "n_routed_experts": "n_routed_experts",
    "n_activated_experts": "num_experts_per_tok",
    "route_scale": "routed_scaling_factor",
    "score_func": "scoring_func",
    "norm_eps": "rms_norm_eps",
    "window_size": "sliding_window",
    "rope_head_dim": "qk_rope_head_dim",
    "n_hash_layers": "num_hash_layers",
    "n_mtp_layers": "num_nextn_predict_layers",
    "kv_source_layers": "kv_source_layer_ids",
    "index_source_layers": "index_source_layer_ids",
    "candidate_source_layer": "candidate_source_layer_id",
    "engram_pad_id": "engram_pad_token_id",
    "dspark_n_activated_experts": "dspark_num_experts_per_tok",
}
_SLIDING = "sliding_attention"
_CSA, _HCA = "compressed_sparse_attention", "heavily_compressed_attention"
_DEFAULT_RATES = {_CSA: 4, _HCA: 128}  # transformers' ``compress_rates`` when absent
V41_RATIOS = (0, 1, 2)
_MODEL_TYPES = ("deepseek_v4", "deepseek_v41")
# Keys the releases and transformers carry that change nothing at inference: accepted silently.
_METADATA = {
    "architectures", "model_type", "dtype", "torch_dtype", "transformers_version", "auto_map", "use_cache",
    "vision_config", "image_token_id", "attention_dropout", "initializer_range", "pad_token_id",
    "text_config", "expert_dtype", "output_router_logits", "router_aux_loss_coef", "router_jitter_noise",
}  # fmt: skip
# Keys read by the translation of transformers' fields or checked below, though not config fields.
_TRANSLATED = {
    "rope_scaling", "layer_types", "mlp_layer_types", "compress_rates", "compress_rate_csa",
    "compress_rate_hca", "partial_rotary_factor", "rope_parameters",
}  # fmt: skip
# Keys with one supported value: anything else would change the numerics this code computes.
_FIXED = {"attention_bias": False, "mlp_bias": False, "topk_method": "noaux_tc"}


@dataclass(frozen=True)
class DSparkConfig:
    """The DSpark draft stages (model-spec §8.2), from the ``dspark_*`` keys: one stage per target layer."""

    target_layer_ids: tuple[int, ...]
    block_size: int
    markov_rank: int
    noise_token_id: int
    n_routed_experts: int = 0  # 0: the backbone's
    num_experts_per_tok: int = 0  # 0: the backbone's

    def __post_init__(self) -> None:
        ids = self.target_layer_ids
        if list(ids) != sorted(set(ids)):
            raise ValueError(f"config: dspark_target_layer_ids={list(ids)} must be sorted and unique")
        for name in ("block_size", "markov_rank"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config: dspark_{name}={getattr(self, name)} must be positive")
        for name in ("n_routed_experts", "num_experts_per_tok"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"config: dspark_{name}={getattr(self, name)} must be >= 0 (0: the backbone's)"
                )


# Nested sections: the dataclass, the prefix of its keys, the key whose non-empty list makes it present, and
# the fields it takes from the model's own keys instead.
_SECTIONS = {
    "engram": (EngramConfig, "engram_", "layer_ids", {"hc_mult": "hc_mult", "hidden_size": "hidden_size",
                                                       "norm_eps": "rms_norm_eps"}),
    "dspark": (DSparkConfig, "dspark_", "target_layer_ids", {}),
}  # fmt: skip


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
        return _num_draft_layers(self.dspark, self.num_nextn_predict_layers)

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
        return _parse(raw)

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


def _parse(raw: dict[str, Any]) -> ModelConfig:
    if not isinstance(raw, dict):
        raise ValueError(f"config must be a JSON object, got {type(raw).__name__}")
    top = raw
    if isinstance(raw.get("text_config"), dict):
        raw = {**{k: v for k, v in top.items() if k != "text_config"}, **raw["text_config"]}
    raw = {_OFFICIAL_NAMES.get(k, k): v for k, v in raw.items()}
    model_type = {"deepseek_v41_text": "deepseek_v41"}.get(raw.get("model_type", ""), raw.get("model_type"))
    if top.get("model_type") == "deepseek_v41":
        model_type = "deepseek_v41"
    if model_type not in _MODEL_TYPES:
        raise ValueError(
            f"config field model_type={model_type!r} is not supported (expected one of {list(_MODEL_TYPES)})"
        )
    raw["model_type"] = model_type
    for key, supported in _FIXED.items():
        if key in raw and raw[key] != supported:
            raise ValueError(f"config field {key}={raw[key]!r} is not supported (only {supported!r})")
    csa, hca = _fold_transformers_fields(raw)

    known = {f.name: f for f in fields(ModelConfig)}
    derived = {"csa_ratio", "hca_ratio", *_SECTIONS}
    section_keys = {key for s in _SECTIONS.values() for key in _section_keys(s[0], s[1], s[3]).values()}
    unknown = sorted(set(raw) - (set(known) - derived) - section_keys - _METADATA - _TRANSLATED - set(_FIXED))
    for key in unknown:  # a release may add metadata: say so, but serve
        warnings.warn(f"config field {key!r} is not known to this implementation; ignoring it", stacklevel=4)
    values: dict[str, Any] = {"csa_ratio": csa, "hca_ratio": hca}
    for name, f in known.items():
        if name in derived:
            continue
        if name not in raw:
            if f.default is f.default_factory:  # dataclasses.MISSING for both: required field
                raise ValueError(f"config is missing the required field {name!r}")
            continue
        values[name] = _coerce(name, raw[name], f.type)
    for name, section in _SECTIONS.items():
        values[name] = _section(raw, *section)
    allowed = V41_RATIOS if model_type == "deepseek_v41" else (0, csa, hca)
    values["compress_ratios"] = _ratios(raw.get("compress_ratios"), values, allowed)
    values["rope_scaling"] = _yarn(raw.get("rope_scaling"))
    cfg = ModelConfig(**values)
    _validate(cfg)
    return cfg


def _fold_transformers_fields(raw: dict[str, Any]) -> tuple[int, int]:
    """Translate transformers' modern fields, check they agree with the legacy ones, and return the
    V4 CSA and HCA ratios (``compress_rates``)."""
    rates = raw.get("compress_rates", {})
    if not isinstance(rates, dict) or set(rates) - {_CSA, _HCA}:
        raise ValueError(f"config field compress_rates={rates!r} must map {_CSA!r} / {_HCA!r} to ratios")
    rates = {**_DEFAULT_RATES, **rates}
    for kind, legacy in ((_CSA, "compress_rate_csa"), (_HCA, "compress_rate_hca")):
        rates[kind] = raw.get(legacy, rates[kind])
    csa, hca = rates[_CSA], rates[_HCA]
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 2 for r in (csa, hca)) or csa == hca:
        raise ValueError(
            f"config compress rates CSA={csa!r} / HCA={hca!r}: both must be distinct integers >= 2 "
            "(the V4 compressors gate at least two tokens; the kinds are told apart by their ratio)"
        )
    if "layer_types" in raw:
        kinds = {_SLIDING: 0, _CSA: csa, _HCA: hca}
        try:
            ratios = [kinds[t] for t in raw["layer_types"]]
        except (KeyError, TypeError) as e:
            raise ValueError(f"config field layer_types has an unknown entry: {e}") from e
        given = raw.get("compress_ratios")
        if given is not None:
            wrong = next((i for i, r in enumerate(ratios) if i >= len(given) or given[i] != r), None)
            if wrong is not None:
                raise ValueError(
                    f"config: layer {wrong} is {raw['layer_types'][wrong]!r} (ratio {ratios[wrong]} with "
                    f"compress_rates CSA={csa}, HCA={hca}), but compress_ratios[{wrong}] is "
                    f"{given[wrong] if wrong < len(given) else 'absent'}"
                )
        raw.setdefault("compress_ratios", ratios)
    if "mlp_layer_types" in raw:
        n_hash = sum(1 for t in raw["mlp_layer_types"] if t == "hash_moe")
        if list(raw["mlp_layer_types"][:n_hash]) != ["hash_moe"] * n_hash:
            raise ValueError("config field mlp_layer_types: hash_moe layers must come first")
        if raw.get("num_hash_layers", n_hash) != n_hash:
            raise ValueError("config fields mlp_layer_types and num_hash_layers disagree")
        raw["num_hash_layers"] = n_hash
    if "partial_rotary_factor" in raw and "head_dim" in raw:
        rope_dim = int(raw["head_dim"] * raw["partial_rotary_factor"])
        if raw.get("qk_rope_head_dim", rope_dim) != rope_dim:
            raise ValueError("config fields partial_rotary_factor and qk_rope_head_dim disagree")
        raw["qk_rope_head_dim"] = rope_dim
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("compress"), dict):
        raw.setdefault("rope_theta", params.get("main", {}).get("rope_theta", 10000.0))
        raw.setdefault("compress_rope_theta", params["compress"].get("rope_theta", 160000.0))
        raw.setdefault("rope_scaling", params["compress"])
    elif isinstance(params, dict):
        raw.setdefault("rope_scaling", params)
    return csa, hca


def _coerce(name: str, value: Any, annotation: str) -> Any:
    kind = annotation.split(" ")[0].split("[")[0]
    if kind == "int" and not (isinstance(value, int) and not isinstance(value, bool)):
        raise ValueError(f"config field {name}={value!r} must be an integer")
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"config field {name}={value!r} must be a number")
        return float(value)
    if kind == "bool" and not isinstance(value, bool):
        raise ValueError(f"config field {name}={value!r} must be true or false")
    if kind == "str" and not isinstance(value, str):
        raise ValueError(f"config field {name}={value!r} must be a string")
    if kind == "tuple":
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise ValueError(f"config field {name}={value!r} must be a list of integers")
        return tuple(value)
    return value


def _section_keys(cls: type, prefix: str, model_keys: dict[str, str]) -> dict[str, str]:
    """A section's fields and the config keys they are read from."""
    return {f.name: model_keys.get(f.name, prefix + f.name) for f in fields(cls)}


def _section(raw: dict[str, Any], cls: type, prefix: str, marker: str, model_keys: dict[str, str]) -> Any:
    """The nested config ``cls`` read once from its prefixed keys (None when its ``marker`` list is absent
    or empty), its own checks run; missing required keys are named."""
    if not raw.get(prefix + marker):
        return None
    types = {f.name: f for f in fields(cls)}
    values = {}
    for name, key in _section_keys(cls, prefix, model_keys).items():
        if key in raw:
            values[name] = _coerce(key, raw[key], types[name].type)
        elif types[name].default is MISSING:
            raise ValueError(f"config is missing the required field {key!r} (with {prefix + marker})")
    return cls(**values)


def _ratios(value: Any, values: dict[str, Any], allowed: tuple[int, ...]) -> tuple[int, ...]:
    """The backbone's ratios then one 0 per draft layer (model-spec §14, open point 6): the list must
    cover the backbone, and every entry past it belongs to a draft layer, which is sliding-only."""
    n_layers = values["num_hidden_layers"]
    if value is None:
        raise ValueError("config is missing the required field 'compress_ratios' (or 'layer_types')")
    if not isinstance(value, (list, tuple)) or not all(isinstance(r, int) for r in value):
        raise ValueError(f"config field compress_ratios={value!r} must be a list of integers")
    if len(value) < n_layers:
        raise ValueError(
            f"config field compress_ratios has {len(value)} entries; num_hidden_layers={n_layers} needs one "
            "per layer"
        )
    bad = [r for r in value[:n_layers] if r not in allowed]
    if bad:
        raise ValueError(f"config field compress_ratios has {bad}; ratios of this model must be in {allowed}")
    for i in range(n_layers, len(value)):
        if value[i] != 0:
            raise ValueError(
                f"config field compress_ratios[{i}]={value[i]}: entries past num_hidden_layers={n_layers} "
                "belong to draft layers, which must be sliding-only (0)"
            )
    drafts = _num_draft_layers(values["dspark"], values.get("num_nextn_predict_layers", 0))
    return tuple(value[:n_layers]) + (0,) * drafts


def _num_draft_layers(dspark: DSparkConfig | None, num_nextn_predict_layers: int) -> int:
    """DSpark has one stage per target layer (V4 releases keep ``num_nextn_predict_layers: 1``)."""
    return len(dspark.target_layer_ids) if dspark else num_nextn_predict_layers


def _yarn(value: Any) -> Yarn | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"config field rope_scaling={value!r} must be an object")
    kind = value.get("rope_type", value.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ValueError(f"config field rope_scaling type {kind!r} is not supported (only 'yarn')")
    try:
        return Yarn(
            factor=float(value["factor"]),
            original_max_position_embeddings=int(value["original_max_position_embeddings"]),
            beta_fast=float(value.get("beta_fast", 32)),
            beta_slow=float(value.get("beta_slow", 1)),
        )
    except KeyError as e:
        raise ValueError(f"config field rope_scaling is missing {e}") from e


def _validate(cfg: ModelConfig) -> None:
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ValueError(f"config: {message}")

    for name in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "head_dim",
        "q_lora_rank",
        "o_groups",
        "o_lora_rank",
        "sliding_window",
        "index_n_heads",
        "index_head_dim",
        "index_topk",
        "n_routed_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "hc_mult",
        "hc_sinkhorn_iters",
    ):
        need(getattr(cfg, name) > 0, f"{name}={getattr(cfg, name)} must be positive")
    need(
        cfg.num_key_value_heads == 1, f"num_key_value_heads={cfg.num_key_value_heads} must be 1 (shared K=V)"
    )
    need(
        0 < cfg.qk_rope_head_dim <= cfg.head_dim and cfg.qk_rope_head_dim % 2 == 0,
        f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be even and in (0, head_dim={cfg.head_dim}]",
    )
    need(
        cfg.qk_rope_head_dim <= cfg.index_head_dim,
        f"qk_rope_head_dim={cfg.qk_rope_head_dim} exceeds index_head_dim={cfg.index_head_dim}",
    )
    need(
        cfg.num_attention_heads % cfg.o_groups == 0,
        f"num_attention_heads={cfg.num_attention_heads} is not a multiple of o_groups={cfg.o_groups}",
    )
    need(
        cfg.num_experts_per_tok <= cfg.n_routed_experts,
        f"num_experts_per_tok={cfg.num_experts_per_tok} exceeds n_routed_experts={cfg.n_routed_experts}",
    )
    need(
        0 <= cfg.num_hash_layers <= cfg.num_hidden_layers,
        f"num_hash_layers={cfg.num_hash_layers} must be in [0, num_hidden_layers={cfg.num_hidden_layers}]",
    )
    need(cfg.n_shared_experts in (0, 1), f"n_shared_experts={cfg.n_shared_experts} must be 0 or 1")
    need(cfg.scoring_func == "sqrtsoftplus", f"scoring_func={cfg.scoring_func!r} is not supported")
    need(cfg.hidden_act == "silu", f"hidden_act={cfg.hidden_act!r} is not supported")
    need(not cfg.tie_word_embeddings, "tie_word_embeddings=true is not supported by DeepSeek V4/V4.1")
    need(cfg.rms_norm_eps > 0 and cfg.hc_eps > 0, "rms_norm_eps and hc_eps must be positive")
    need(cfg.gate_temp > 0, f"gate_temp={cfg.gate_temp} must be positive")
    for name in ("bos_token_id", "eos_token_id"):
        need(
            0 <= getattr(cfg, name) < cfg.vocab_size,
            f"{name}={getattr(cfg, name)} is outside the vocabulary [0, {cfg.vocab_size})",
        )
    # The indexer and top-k kernels' limits, so a checkpoint they cannot serve fails at load.
    need(
        cfg.index_topk <= topk.MAX_K,
        f"index_topk={cfg.index_topk} exceeds the top-k kernel limit {topk.MAX_K}",
    )
    need(
        cfg.index_n_heads <= indexer.MAX_HEADS and cfg.index_head_dim <= indexer.MAX_DIM,
        f"index_n_heads={cfg.index_n_heads} / index_head_dim={cfg.index_head_dim} exceed the indexer kernel "
        f"limits {indexer.MAX_HEADS} / {indexer.MAX_DIM}",
    )
    if cfg.is_dspark:
        _validate_dspark(cfg, need)
    if cfg.is_v41:
        _validate_v41(cfg, need)
    else:
        v41_only = [n for n in ("kv_source_layer_ids", "index_source_layer_ids", "engram") if getattr(cfg, n)]
        need(not v41_only, f"{v41_only} are V4.1 fields, but model_type is {cfg.model_type!r}")
    q = cfg.quantization_config
    if q is not None:
        block = q.get("weight_block_size") if isinstance(q, dict) else None
        need(
            isinstance(block, list) and len(block) == 2 and block[0] == block[1] and block[0] > 0,
            f"quantization_config.weight_block_size={block!r} must be [B, B] with B > 0",
        )
        need(
            q.get("quant_method", "fp8") == "fp8",
            f"quantization_config.quant_method={q.get('quant_method')!r} is not supported (only 'fp8')",
        )


def _validate_v41(cfg: ModelConfig, need: Callable[[bool, str], None]) -> None:
    """The V4.1 cross-field rules of model-spec §2."""
    n_layers, ratios = cfg.num_hidden_layers, cfg.compress_ratios
    engram_ids = {"engram_layer_ids": cfg.engram.layer_ids} if cfg.engram else {}
    for name, ids in {
        "kv_source_layer_ids": cfg.kv_source_layer_ids,
        "index_source_layer_ids": cfg.index_source_layer_ids,
        **engram_ids,
    }.items():
        need(list(ids) == sorted(set(ids)), f"{name}={list(ids)} must be sorted and unique")
        need(all(0 <= i < n_layers for i in ids), f"{name}={list(ids)} must lie in [0, {n_layers})")
    need(cfg.num_hash_layers == 0, f"num_hash_layers={cfg.num_hash_layers}: V4.1 has no hash-routed layers")
    kv, index = cfg.kv_source_layer_ids, cfg.index_source_layer_ids
    need(set(kv) <= set(index), f"kv_source_layer_ids={list(kv)} must all be index sources {list(index)}")
    for layer in range(n_layers):
        if ratios[layer] == 0:
            need(layer not in index, f"index source {layer} has compress_ratios[{layer}]=0")
            continue
        for name, ids in (("kv_source_layer_ids", kv), ("index_source_layer_ids", index)):
            source = max((s for s in ids if s <= layer), default=None)
            need(source is not None, f"layer {layer} (ratio {ratios[layer]}) has no source in {name}")
            need(
                ratios[source] == ratios[layer],
                f"layer {layer} has ratio {ratios[layer]}, its {name} source {source} has {ratios[source]}",
            )
    cand = cfg.candidate_source_layer_id
    if cand >= 0:
        need(
            cand in kv and cand in index, f"candidate_source_layer_id={cand} must be a KV and an index source"
        )
        need(
            cfg.candidate_topk_blocks > 0 and cfg.candidate_block_size > 0,
            "candidate_topk_blocks and candidate_block_size must be positive with a candidate source",
        )
        consumers = [s for s in index if s > cand and ratios[s] != ratios[cand]]
        need(not consumers, f"index sources {consumers} above candidate source {cand} have another ratio")
        topk.check_candidate_geometry(cfg.candidate_block_size, cfg.candidate_topk_blocks)
        reach = (cfg.candidate_topk_blocks - 1) * cfg.candidate_block_size + 1
        need(
            reach >= cfg.index_topk,
            f"(candidate_topk_blocks-1)*candidate_block_size+1={reach} is below index_topk={cfg.index_topk}",
        )
    if cfg.engram:  # the section checked its own fields (and the prime layout) when parsed
        need(
            0 <= cfg.engram.pad_token_id < cfg.vocab_size,
            f"engram_pad_token_id={cfg.engram.pad_token_id} is outside the vocabulary [0, {cfg.vocab_size})",
        )
    need(
        cfg.is_dspark or not cfg.num_nextn_predict_layers,
        f"num_nextn_predict_layers={cfg.num_nextn_predict_layers}: V4.1 draft layers are DSpark stages, "
        "but dspark_target_layer_ids is empty",
    )


def _validate_dspark(cfg: ModelConfig, need: Callable[[bool, str], None]) -> None:
    """DSpark of either family (model-spec §8.2), against the backbone."""
    dspark, n_layers = cfg.dspark, cfg.num_hidden_layers
    ids = dspark.target_layer_ids
    need(
        all(0 <= i < n_layers for i in ids),
        f"dspark_target_layer_ids={list(ids)} must lie in [0, {n_layers})",
    )
    need(
        0 <= dspark.noise_token_id < cfg.vocab_size,
        f"dspark_noise_token_id={dspark.noise_token_id} is outside [0, vocab_size={cfg.vocab_size})",
    )
    experts = dspark.n_routed_experts or cfg.n_routed_experts
    top_k = dspark.num_experts_per_tok or cfg.num_experts_per_tok
    need(top_k <= experts, f"dspark_num_experts_per_tok={top_k} exceeds dspark_n_routed_experts={experts}")
