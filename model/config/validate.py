"""The cross-field contracts of a model config (model-spec §2, §8.2) and the kernels' limits."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from model.config.schema import ModelConfig


def validate(cfg: ModelConfig) -> None:
    """Every cross-field contract of ``cfg``, and the kernels' limits: a checkpoint they cannot serve fails
    here, naming the field."""

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
    _check_kernel_limits(cfg, need)
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


def _check_kernel_limits(cfg: ModelConfig, need: Callable[[bool, str], None]) -> None:
    """The indexer's and top-k's limits, so that a checkpoint they cannot serve fails at load."""
    # Plain constants, imported here: importing the config loads no kernel package.
    from triton_kernels import limits

    need(
        cfg.index_topk <= limits.MAX_K,
        f"index_topk={cfg.index_topk} exceeds the top-k kernel limit {limits.MAX_K}",
    )
    need(
        cfg.index_n_heads <= limits.INDEXER_MAX_HEADS and cfg.index_head_dim <= limits.INDEXER_MAX_DIM,
        f"index_n_heads={cfg.index_n_heads} / index_head_dim={cfg.index_head_dim} exceed the indexer kernel "
        f"limits {limits.INDEXER_MAX_HEADS} / {limits.INDEXER_MAX_DIM}",
    )
    if cfg.is_v41 and cfg.candidate_source_layer_id >= 0:
        limits.check_candidate_geometry(cfg.candidate_block_size, cfg.candidate_topk_blocks)
