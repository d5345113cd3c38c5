"""Config parsing: every accepted spelling, and clear errors naming the field."""

from __future__ import annotations

import pytest

from model.config import ModelConfig
from model.plan import Attention, Rope, build_plan
from model.testing.tiny import TOY_V4

RAW = {**TOY_V4, "vocab_size": 4096}


def test_toy_plan():
    cfg = ModelConfig.from_dict(RAW)
    plan = build_plan(cfg)
    assert [p.attention for p in plan] == [
        Attention.SLIDING,
        Attention.SLIDING,
        Attention.CSA,
        Attention.HCA,
        Attention.CSA,
        Attention.HCA,
        Attention.SLIDING,
    ]
    assert [p.hash_moe for p in plan] == [True, True, False, False, False, False, False]
    assert [p.is_draft for p in plan] == [False] * 6 + [True]
    assert [p.rope for p in plan] == [Rope.MAIN, Rope.MAIN] + [Rope.COMPRESS] * 4 + [Rope.MAIN]
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 16


def test_ratio_list_is_neither_padded_nor_truncated():
    """Open point 6: the backbone needs all its entries; entries past it are the draft layers' zeros."""
    with pytest.raises(ValueError, match="compress_ratios has 3 entries; num_hidden_layers=6"):
        ModelConfig.from_dict({**RAW, "compress_ratios": [0, 0, 4]})
    backbone = RAW["compress_ratios"][:6]
    for extra in ([], [0], [0, 0, 0]):  # V4-Flash carries one 0 per draft layer, 0731 three
        cfg = ModelConfig.from_dict({**RAW, "compress_ratios": backbone + extra})
        assert cfg.compress_ratios == (*backbone, 0)
    with pytest.raises(ValueError, match=r"compress_ratios\[8\]=4: .*draft layers"):
        ModelConfig.from_dict({**RAW, "compress_ratios": [*backbone, 0, 0, 4]})


def test_transformers_layer_types_with_other_compress_rates():
    """transformers' layer kinds with their ratios (here HCA 16, CSA 8): the kernels take any ratio >= 2."""
    modern = {k: v for k, v in RAW.items() if k != "compress_ratios"}
    layer_types = ["sliding_attention"] * 2 + [
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ] * 2
    rates = {"compressed_sparse_attention": 8, "heavily_compressed_attention": 16}
    cfg = ModelConfig.from_dict({**modern, "layer_types": layer_types, "compress_rates": rates})
    assert cfg.compress_ratios == (0, 0, 8, 16, 8, 16, 0)
    kinds = [p.attention for p in build_plan(cfg)]
    assert kinds == [Attention.SLIDING] * 2 + [Attention.CSA, Attention.HCA] * 2 + [Attention.SLIDING]
    legacy = {**modern, "layer_types": layer_types, "compress_rate_hca": 16}
    assert ModelConfig.from_dict(legacy).compress_ratios == (0, 0, 4, 16, 4, 16, 0)
    both = {**RAW, "layer_types": layer_types, "compress_rates": {"heavily_compressed_attention": 16}}
    with pytest.raises(ValueError, match=r"layer 3 is 'heavily_compressed_attention' \(ratio 16.*is 128"):
        ModelConfig.from_dict(both)
    with pytest.raises(ValueError, match="distinct integers >= 2"):
        ModelConfig.from_dict(
            {
                **modern,
                "layer_types": layer_types,
                "compress_rates": {**rates, "compressed_sparse_attention": 16},
            }
        )


def test_wrapped_official_and_transformers_spellings_agree():
    base = ModelConfig.from_dict(RAW)
    assert ModelConfig.from_dict({"model_type": "deepseek_v4", "text_config": RAW}) == base
    official = {
        ("dim" if k == "hidden_size" else "n_layers" if k == "num_hidden_layers" else k): v
        for k, v in RAW.items()
    }
    assert ModelConfig.from_dict(official) == base
    modern = {
        k: v for k, v in RAW.items() if k not in ("compress_ratios", "num_hash_layers", "qk_rope_head_dim")
    }
    modern["layer_types"] = ["sliding_attention"] * 2 + [
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ] * 2
    modern["mlp_layer_types"] = ["hash_moe"] * 2 + ["moe"] * 4
    modern["partial_rotary_factor"] = 0.25
    parsed = ModelConfig.from_dict(modern)
    assert parsed.compress_ratios == base.compress_ratios and parsed.num_hash_layers == 2
    assert parsed.qk_rope_head_dim == 16


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": "128"}, "hidden_size"),
        ({"compress_ratios": [0, 3]}, "compress_ratios"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"o_groups": 3}, "o_groups"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"qk_rope_head_dim": 15}, "qk_rope_head_dim"),
        ({"model_type": "llama"}, "model_type"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"rope_scaling": {"type": "linear", "factor": 2}}, "rope_scaling"),
        ({"compress_ratios": [0, 0, 4, 128, 4, 128, 4]}, "draft layers"),
        (
            {"compress_ratios": [0, 0, 4, 16, 4, 128, 0]},
            r"\[16\]; ratios of this model must be in \(0, 4, 128\)",
        ),
        ({"attention_bias": True}, "attention_bias=True is not supported"),
        ({"topk_method": "greedy"}, "topk_method"),
        ({"eos_token_id": 5000}, "eos_token_id"),
        ({"layer_types": ["sliding_attention"] * 6}, r"layer 2 is 'sliding_attention' \(ratio 0"),
        ({"quantization_config": {"weight_block_size": [32, 64]}}, "weight_block_size"),
    ],
)
def test_bad_field_is_named(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**RAW, **change})


def test_missing_field_is_named():
    with pytest.raises(ValueError, match="'head_dim'"):
        ModelConfig.from_dict({k: v for k, v in RAW.items() if k != "head_dim"})


def test_unreadable_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        ModelConfig.from_file(tmp_path)
