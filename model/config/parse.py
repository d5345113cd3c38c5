"""Reading a ``config.json`` into the schema's fields.

Accepts the Hugging Face naming (``deepseek_v4``, optionally wrapped in ``text_config``), the
legacy fields of the official release (``compress_ratios``, ``num_hash_layers``,
``qk_rope_head_dim``) and the official ``inference/config.json`` names (``dim``, ``n_layers``...).
"""

from __future__ import annotations

import warnings
from dataclasses import MISSING, fields
from typing import TYPE_CHECKING, Any

from model.config.sections import DSparkConfig, EngramConfig, Yarn, num_draft_layers
from model.config.validate import validate

if TYPE_CHECKING:  # the schema reads its configs with this module: it hands its class in
    from model.config.schema import ModelConfig

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


# Nested sections: the dataclass, the prefix of its keys, the key whose non-empty list makes it present, and
# the fields it takes from the model's own keys instead.
_SECTIONS = {
    "engram": (EngramConfig, "engram_", "layer_ids", {"hc_mult": "hc_mult", "hidden_size": "hidden_size",
                                                       "norm_eps": "rms_norm_eps"}),
    "dspark": (DSparkConfig, "dspark_", "target_layer_ids", {}),
}  # fmt: skip


def parse(raw: dict[str, Any], schema: type[ModelConfig]) -> ModelConfig:
    """``raw``, a config.json's object, as a ``schema`` (``ModelConfig``), validated."""
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

    known = {f.name: f for f in fields(schema)}
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
    cfg = schema(**values)
    validate(cfg)
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
    drafts = num_draft_layers(values["dspark"], values.get("num_nextn_predict_layers", 0))
    return tuple(value[:n_layers]) + (0,) * drafts


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
