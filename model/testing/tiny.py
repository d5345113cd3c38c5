"""Tiny random checkpoints in the official naming, for tests and the default server.

``write_tiny`` (``python -m model.testing --arch v4|v4-dspark|v41 --out DIR [--fp8] [--shards N]``) writes
``config.json``, safetensors and the project tokenizer. Weights are seeded and deterministic; norms, mHC,
sinks, ``ape`` and gate biases get non-trivial values (zeros and ones would let an implementation that
ignores them pass), and one routed expert per layer is scaled so the SwiGLU clamp is hit (model-spec §12).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from model.checkpoint import INDEX_FILE, SINGLE_FILE
from model.config import ModelConfig
from model.deepseek_v4 import DeepseekV4
from model.deepseek_v41 import DeepseekV41
from model.engram import compressed_token_map
from model.quant import quantize_fp4, quantize_fp8
from model.tokenizer import NOISE_TOKEN_ID, load_tokenizer, write_tokenizer

TOY_V4 = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "dtype": "float32",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "hidden_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 64,
    "o_groups": 2,
    "o_lora_rank": 32,
    "sliding_window": 32,
    "compress_ratios": [0, 0, 4, 128, 4, 128, 0],
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 1048576,
    "index_n_heads": 32,
    "index_head_dim": 32,
    "index_topk": 16,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-06,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "num_hash_layers": 2,
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-06,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1,
}
TOY_V41_TEXT = {
    **{k: TOY_V4[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                              "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window",
                              "rope_theta", "compress_rope_theta", "max_position_embeddings", "hc_mult",
                              "hc_sinkhorn_iters", "hc_eps", "n_routed_experts", "n_shared_experts",
                              "num_experts_per_tok", "moe_intermediate_size", "scoring_func", "topk_method",
                              "norm_topk_prob", "routed_scaling_factor", "swiglu_limit", "hidden_act",
                              "attention_bias", "tie_word_embeddings")},
    "model_type": "deepseek_v41_text",
    "num_hidden_layers": 10,
    "compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1],
    "kv_source_layer_ids": [2, 4, 6],
    "index_source_layer_ids": [2, 4, 6, 8],
    "candidate_source_layer_id": 6,
    "candidate_topk_blocks": 6,
    "candidate_block_size": 4,
    "index_n_heads": 16,
    "index_head_dim": 32,
    "index_topk": 16,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "rms_norm_eps": 1e-20,
    "engram_layer_ids": [1, 4],
    "engram_num_embeddings": [6126, 6332],
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 1000,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_pad_token_id": 2,
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 5,
    "dspark_target_layer_ids": [7, 8, 9],
    "dspark_markov_rank": 16,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 2,
}  # fmt: skip
FP8_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "scale_fmt": "ue8m0",
    "weight_block_size": [32, 32],
    "expert_dtype": "fp4",
}
# Linears stored as FP8 in the official checkpoints.
_FP8_LINEARS = (
    "attn.wq_a.",
    "attn.wq_b.",
    "attn.wkv.",
    "attn.wo_a.",
    "attn.wo_b.",
    "indexer.wq_b.",
    "shared_experts.",
    "engram.wkv.",
    "e_proj.",
    "h_proj.",
)
_CLAMPED_EXPERT = 0  # this expert of every layer is scaled up so its SwiGLU clamp is hit


# The V4-Flash-0731 / V4-Pro-0813 layout: the toy V4 with three DSpark stages instead of MTP, the MTP
# layer count kept at 1 as in those releases, and one sliding-only ratio per stage.
TOY_V4_DSPARK = {
    **TOY_V4,
    "compress_ratios": [0, 0, 4, 128, 4, 128, 0, 0, 0],
    "dspark_block_size": 5,
    "dspark_target_layer_ids": [3, 4, 5],
    "dspark_markov_rank": 16,
}
ARCHS = ("v4", "v4-dspark", "v41")
# Bump when the writer's output changes for the same config (tensor names, weight init): the cached
# checkpoints of older formats are then left alone instead of read back.
TINY_FORMAT = 2


def toy_config(arch: str) -> dict:
    """model-spec §12 with the project tokenizer's vocabulary, noise id and Engram token count."""
    tokenizer = load_tokenizer()
    if arch == "v4":
        return {**TOY_V4, "vocab_size": tokenizer.get_vocab_size()}
    if arch == "v4-dspark":
        return {
            **TOY_V4_DSPARK,
            "vocab_size": tokenizer.get_vocab_size(),
            "dspark_noise_token_id": NOISE_TOKEN_ID,
        }
    if arch != "v41":
        raise ValueError(f"unknown tiny architecture {arch!r} (available: {ARCHS})")
    text = {
        **TOY_V41_TEXT,
        "vocab_size": tokenizer.get_vocab_size(),
        "dspark_noise_token_id": NOISE_TOKEN_ID,
        "engram_compressed_vocab_size": compressed_token_map(tokenizer)[1],
    }
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "float32",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "text_config": text,
    }


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        shapes = (DeepseekV41(cfg) if cfg.is_v41 else DeepseekV4(cfg)).checkpoint_names()
    gen = torch.Generator().manual_seed(seed)

    def normal(shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std + mean

    weights = {}
    for name, shape in sorted(shapes.items()):
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("tid2eid"):
            t = torch.stack(
                [torch.randperm(cfg.n_routed_experts, generator=gen)[: shape[1]] for _ in range(shape[0])]
            )
        elif name.endswith(".engram.embed.weight"):
            t = normal(shape, 0.02)
        elif name.endswith("norm.weight") or leaf in ("q_weight", "k_weight"):
            t = normal(shape, 0.1, 1.0)
        elif leaf.endswith("_scale"):  # mHC scales
            t = normal(shape, 0.1, 1.0)
        elif leaf.endswith("_fn"):  # mHC projections read the whole n*D stream
            t = normal(shape, 1.0 / math.sqrt(shape[1]))
        elif leaf.endswith("_base") or leaf in ("attn_sink", "ape", "bias"):
            t = normal(shape, 0.5)
        elif name == "embed.weight":
            t = normal(shape, 1.0)
        else:  # linear [out, in]
            t = normal(shape, 1.0 / math.sqrt(shape[1]))
        weights[name] = t
    for name in weights:
        if f".experts.{_CLAMPED_EXPERT}.w1." in name or f".experts.{_CLAMPED_EXPERT}.w3." in name:
            weights[name] *= 8.0
        elif f".experts.{_CLAMPED_EXPERT}.w2." in name:
            weights[name] /= 8.0
    return weights


def quantize(weights: dict[str, torch.Tensor], block: int) -> dict[str, torch.Tensor]:
    """The official storage: FP8 linears, MXFP4 routed experts, FP8 Engram tables with per-row scales."""
    out = {}
    for name, t in weights.items():
        scale_name = name.removesuffix(".weight") + ".scale"
        if re.search(r"\.experts\.\d+\.w[123]\.weight$", name):
            out[name], out[scale_name] = quantize_fp4(t)
        elif name.endswith(".engram.embed.weight"):
            out[name], out[scale_name] = quantize_fp8(t, block, row_block=1)
        elif name.endswith(".weight") and any(k in name for k in _FP8_LINEARS):
            out[name], out[scale_name] = quantize_fp8(t, block)
        else:
            out[name] = t
    return out


def write_tiny(out: str | Path, arch: str = "v4", fp8: bool = False, shards: int = 1, seed: int = 0) -> Path:
    if shards < 1:
        raise ValueError(f"shards={shards} must be at least 1")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw = toy_config(arch)
    if fp8:
        raw["quantization_config"] = FP8_CONFIG
    cfg = ModelConfig.from_dict(raw)
    weights = random_weights(cfg, seed)
    if fp8:
        weights = quantize(weights, cfg.fp8_block)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    names = sorted(weights)
    if shards == 1:
        save_file({n: weights[n].contiguous() for n in names}, out / SINGLE_FILE)
    else:
        weight_map = {}
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = names[i::shards]
            save_file({n: weights[n].contiguous() for n in part}, out / file)
            weight_map.update(dict.fromkeys(part, file))
        (out / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2) + "\n")
    write_tokenizer(out)
    return out


def cached_tiny(arch: str) -> Path:
    """The tiny checkpoint of ``arch`` in the user cache, written on first use; the folder is named by
    the writer's format and a hash of the config, so a checkpoint of another format is never read."""
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "deepseek-ascend"
    digest = hashlib.sha256(json.dumps(toy_config(arch), sort_keys=True).encode()).hexdigest()[:12]
    path = root / f"tiny-{arch}-v{TINY_FORMAT}-{digest}"
    if not (path / "config.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=root))  # renamed into place whole: no half-written checkpoint
        write_tiny(staging, arch)
        try:
            staging.rename(path)
        except OSError:  # another process won the race
            shutil.rmtree(staging)
    return path
