"""The width-faithful writer stores each tensor class as its layout does (model-spec §9.1, §9.5), and its
config is the release's with few layers and experts."""

from __future__ import annotations

import pytest
import torch

from model.config import ModelConfig
from model.testing.release_like import like_config, stored

E8M0 = torch.float8_e8m0fnu


def test_the_config_keeps_the_release_widths():
    cfg = ModelConfig.from_dict(like_config("v4-flash", 2, 16))
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.vocab_size) == (4096, 64, 512, 129280)
    assert (cfg.num_hidden_layers, cfg.n_routed_experts, cfg.fp8_block) == (2, 16, 128)
    with pytest.raises(ValueError, match="experts=4"):
        like_config("v4-flash", 2, 4)  # fewer experts than the release's top-6


@pytest.mark.parametrize(
    "layout, name, expected",
    [
        (
            "official",
            "layers.0.attn.wq_a.weight",
            {"": (torch.float8_e4m3fn, (200, 300)), "scale": (E8M0, (2, 3))},
        ),
        (
            "official",
            "layers.0.ffn.experts.3.w2.weight",
            {"": (torch.int8, (200, 150)), "scale": (E8M0, (200, 10))},
        ),
        ("official", "layers.0.attn.compressor.wkv.weight", {"": (torch.bfloat16, (200, 300))}),
        ("official", "layers.0.attn.attn_sink", {"": (torch.float32, (200, 300))}),
        ("msmodelslim", "layers.0.attn.wo_a.weight", {"": (torch.bfloat16, (200, 300))}),
        (
            "msmodelslim",
            "layers.0.ffn.experts.3.w1.weight",
            {
                "": (torch.int8, (200, 300)),
                "weight_scale": (torch.float32, (200, 1)),
                "weight_offset": (torch.float32, (200, 1)),
            },
        ),  # fmt: skip
        (
            "msmodelslim-w4a8",
            "layers.0.ffn.experts.3.w2.weight",
            {
                "": (torch.int8, (100, 300)),  # two int4 outputs per byte row
                "weight_scale": (torch.float32, (200, 1)),
                "weight_offset": (torch.float32, (200, 1)),
                "scale_bias": (torch.float32, (200, 16)),
            },
        ),  # fmt: skip
        (
            "msmodelslim-w4a8",
            "layers.0.attn.wq_a.weight",
            {
                "": (torch.int8, (200, 300)),
                "weight_scale": (torch.float32, (200, 1)),
                "weight_offset": (torch.float32, (200, 1)),
            },
        ),  # fmt: skip
    ],
)
def test_each_tensor_class_is_stored_as_its_layout_does(layout, name, expected):
    parts = stored(name, (200, 300), layout, 16, torch.Generator().manual_seed(0))
    base = name.removesuffix(".weight")
    want = {(f"{base}.{suffix}" if suffix else name): spec for suffix, spec in expected.items()}
    assert {n: (t.dtype, tuple(t.shape)) for n, t in parts.items()} == want
    if parts[name].dtype == torch.float8_e4m3fn:
        assert not ((parts[name].view(torch.uint8) & 0x7F) == 0x7F).any()  # no NaN codes
