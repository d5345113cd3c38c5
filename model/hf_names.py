"""The official DeepSeek V4 tensor names in transformers' naming (model-spec §10.2).

Used to load our checkpoints into transformers' ``DeepseekV4ForCausalLM``, the V4 oracle.
"""

from __future__ import annotations

import re

import torch

# Official name -> transformers name, applied in order (model-spec §10.2).
_RENAMES = [
    (r"^embed\.weight$", "model.embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"^layers\.", "model.layers."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn\.indexer\.compressor\.", ".self_attn.compressor.indexer."),
    (r"\.attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.scorer.weights_proj."),
    (r"\.attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.compressor\.(indexer\.)?norm\.", r".compressor.\1kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.wq_b\.", ".q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]
_EXPERT = re.compile(r"^(layers\.\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")


def to_transformers(official: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename official tensors to transformers' names; routed experts are stacked per layer."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, t in official.items():
        if name.startswith("mtp."):
            continue  # transformers has no draft head
        m = _EXPERT.match(name)
        if m:
            experts.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = t
            continue
        for pattern, repl in _RENAMES:
            name = re.sub(pattern, repl, name)
        out[name] = t
    for layer, ws in experts.items():
        stack = {w: torch.stack([ws[w][e] for e in sorted(ws[w])]) for w in ws}
        out[f"model.{layer}.mlp.experts.gate_up_proj"] = torch.cat([stack["w1"], stack["w3"]], dim=1)
        out[f"model.{layer}.mlp.experts.down_proj"] = stack["w2"]
    return out
