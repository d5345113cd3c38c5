"""Checkpoint loading: strict names and shapes, FP8 block scales, bad token ids, the released configs'
keys, checkpoints without draft tensors and the DSpark layouts of both families."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.llm_engine import EngineConfig, LLMEngine
from model.checkpoint import SINGLE_FILE, load_model
from model.quant import dequantize_fp4, dequantize_fp8, quantize_fp4, quantize_fp8
from model.testing.tiny import write_tiny
from model.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("tiny"))


def _rewrite(src, dst, edit):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / SINGLE_FILE)
    edit(tensors)
    save_file(tensors, dst / SINGLE_FILE)
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")  # V4.1 Engram reads it
    return dst


def test_tiny_is_deterministic(tmp_path, tiny_dir):
    again = write_tiny(tmp_path / "again")
    a, b = load_file(tiny_dir / SINGLE_FILE), load_file(again / SINGLE_FILE)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((again / "config.json").read_text())["vocab_size"] == 4096


def test_sharded_equals_single(tmp_path, tiny_dir):
    sharded = load_model(write_tiny(tmp_path / "sharded", shards=3))
    single = load_model(tiny_dir)
    for (name, a), (_, b) in zip(sharded.state_dict().items(), single.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_missing_unexpected_and_misshaped_tensors_are_listed(tmp_path, tiny_dir):
    def edit(t):
        del t["layers.2.attn.indexer.wq_b.weight"]
        t["layers.0.attn.surprise"] = torch.zeros(1)
        t["layers.1.attn.attn_sink"] = torch.zeros(7)

    with pytest.raises(ValueError) as err:
        load_model(_rewrite(tiny_dir, tmp_path / "bad", edit))
    text = str(err.value)
    assert "missing: layers.2.attn.indexer.wq_b.weight" in text
    assert "unexpected: layers.0.attn.surprise" in text
    assert "layers.1.attn.attn_sink (7,) != (4,)" in text


def test_fp8_weight_without_scale_is_an_error(tmp_path, tiny_dir):
    def edit(t):
        t["layers.0.attn.wq_a.weight"] = t["layers.0.attn.wq_a.weight"].to(torch.float8_e4m3fn)

    with pytest.raises(ValueError, match="layers.0.attn.wq_a.weight"):
        load_model(_rewrite(tiny_dir, tmp_path / "noscale", edit))


def test_no_weights_file(tmp_path):
    (tmp_path / "config.json").write_text((write_tiny(tmp_path / "src") / "config.json").read_text())
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(tmp_path)


@pytest.mark.parametrize("bad", [-1, -4096, 4096, 10**6])
def test_token_ids_outside_vocabulary(tiny_dir, bad):
    model = load_model(tiny_dir)
    with pytest.raises(ValueError, match=f"token id {bad} is outside the vocabulary"):
        model(torch.tensor([5, bad, 7]))


def test_empty_or_malformed_ids(tiny_dir):
    model = load_model(tiny_dir)
    with pytest.raises(ValueError, match="empty"):
        model(torch.tensor([], dtype=torch.int64))
    with pytest.raises(ValueError, match="1-D integer"):
        model(torch.tensor([[1, 2]]))


def test_e8m0_scale_bytes():
    weight = torch.ones(2, 2).to(torch.float8_e4m3fn)
    for byte, value in ((127, 1.0), (128, 2.0), (120, 2.0**-7)):
        scale = torch.tensor([[byte]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
        assert torch.equal(dequantize_fp8(weight, scale, 32, torch.float32), torch.full((2, 2), value))
    nan = torch.tensor([[255]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    with pytest.raises(ValueError, match="NaN"):
        dequantize_fp8(weight, nan, 32, torch.float32)


def test_fp8_round_trip_within_e4m3_precision():
    w = torch.randn(70, 45, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 45)
    q, scale = quantize_fp8(w, 32)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 2)
    back = dequantize_fp8(q, scale, 32, torch.float32)
    block_max = w.abs().view(70, 45).amax()
    assert ((back - w).abs() <= w.abs() / 16 + block_max * 2.0**-9).all()
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_fp8(q, scale[:1], 32, torch.float32)


def test_fp8_per_row_scales_of_engram_tables():
    w = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)) * torch.arange(1, 6)[:, None]
    q, scale = quantize_fp8(w, 32, row_block=1)
    assert scale.shape == (5, 2)
    back = dequantize_fp8(q, scale, 32, torch.float32)
    assert ((back - w).abs() <= w.abs() / 16 + 2.0**-6).all()


def test_fp4_codes_low_nibble_first_and_round_trip():
    scale = torch.ones(1, 1).to(torch.float8_e8m0fnu)
    packed = torch.full((1, 16), 0xA0, dtype=torch.uint8).view(
        torch.int8
    )  # high nibble 0xA = -1.0, low 0x0 = 0
    assert dequantize_fp4(packed, scale, torch.float32)[0, :2].tolist() == [0.0, -1.0]
    codes = torch.full((1, 16), 0x71, dtype=torch.uint8).view(torch.int8)  # low 1 -> 0.5, high 7 -> 6.0
    two = torch.tensor([[128]], dtype=torch.uint8).view(torch.float8_e8m0fnu)  # E8M0 128 = 2.0
    assert dequantize_fp4(codes, two, torch.float32)[0, :2].tolist() == [1.0, 12.0]
    w = torch.tensor([[0.0, 0.5, -1.5, 3.0, 6.0, -6.0, 2.0, 4.0] * 4])
    packed, s = quantize_fp4(w)
    assert torch.equal(dequantize_fp4(packed, s, torch.float32), w)  # representable values survive exactly
    with pytest.raises(ValueError, match="FP4 scale shape"):
        dequantize_fp4(packed, torch.ones(2, 1).to(torch.float8_e8m0fnu), torch.float32)


# Every key of the released V4.1 text_config (model-spec §2), the metadata included.
V41_RELEASE_TEXT_KEYS = (
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
    "sliding_window", "compress_ratios", "rope_theta", "compress_rope_theta", "rope_scaling",
    "max_position_embeddings", "index_n_heads", "index_head_dim", "index_topk", "kv_source_layer_ids",
    "index_source_layer_ids", "candidate_source_layer_id", "candidate_topk_blocks", "candidate_block_size",
    "hc_mult", "hc_sinkhorn_iters", "hc_eps", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
    "moe_intermediate_size", "scoring_func", "topk_method", "norm_topk_prob", "routed_scaling_factor",
    "swiglu_limit", "hidden_act", "rms_norm_eps", "tie_word_embeddings", "num_nextn_predict_layers",
    "dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank",
    "dspark_n_routed_experts", "dspark_num_experts_per_tok", "engram_layer_ids", "engram_num_embeddings",
    "engram_max_ngram_size", "engram_vocab_size", "engram_n_heads", "engram_head_dim", "engram_pad_token_id",
    "engram_compressed_vocab_size", "attention_bias", "attention_dropout", "initializer_range", "use_cache",
    "dtype", "torch_dtype", "transformers_version",
)  # fmt: skip
V41_RELEASE_METADATA = {
    "text_config": {
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
        "transformers_version": "5.0.0",
    },
    "transformers_version": "5.0.0",
    "tie_word_embeddings": False,
    "image_token_id": 129264,
    "vision_config": {"model_type": "deepseek_v41_vision", "hidden_size": 64},
    "auto_map": {"AutoConfig": "configuration_deepseek_v41.DeepseekV41Config"},
}


@pytest.fixture(scope="module")
def tiny_v41_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("tiny-v41"), arch="v41")


def _with_config(src, dst, edit):
    """A copy of checkpoint ``src`` whose config.json ``edit`` changed."""
    shutil.copytree(src, dst)
    raw = json.loads((src / "config.json").read_text())
    edit(raw)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def _release_config(raw):
    for key, value in V41_RELEASE_METADATA.items():
        if isinstance(value, dict) and key == "text_config":
            raw[key].update(value)
        else:
            raw[key] = value


def _load_recording_warnings(path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_model(path)
    return model, [str(w.message) for w in caught]


def test_release_v41_config_keys_load_silently(tmp_path, tiny_v41_dir):
    path = _with_config(tiny_v41_dir, tmp_path / "release", _release_config)
    text = json.loads((path / "config.json").read_text())["text_config"]
    assert set(V41_RELEASE_TEXT_KEYS) <= set(text)
    model, caught = _load_recording_warnings(path)
    assert caught == [] and model.cfg.is_dspark


def test_unknown_config_key_loads_with_one_warning_naming_it(tmp_path, tiny_v41_dir):
    def edit(raw):
        _release_config(raw)
        raw["text_config"]["frobnication_level"] = 3

    model, caught = _load_recording_warnings(_with_config(tiny_v41_dir, tmp_path / "invented", edit))
    assert len(caught) == 1 and "'frobnication_level'" in caught[0]
    assert model.cfg == load_model(tiny_v41_dir).cfg


@pytest.mark.parametrize("change", [{"attention_bias": True}, {"topk_method": "greedy"}])
def test_supported_key_with_unsupported_value_is_an_error(tmp_path, tiny_v41_dir, change):
    [(key, value)] = change.items()
    path = _with_config(tiny_v41_dir, tmp_path / "bad", lambda raw: raw["text_config"].update(change))
    with pytest.raises(ValueError, match=f"{key}={value!r} is not supported"):
        load_model(path)


@pytest.mark.parametrize("arch", ["v4", "v4-dspark", "v41"])
def test_checkpoint_without_draft_tensors_loads_without_speculation(tmp_path, arch):
    src = write_tiny(tmp_path / "src", arch=arch)
    stripped = _rewrite(
        src, tmp_path / "stripped", lambda t: [t.pop(n) for n in list(t) if n.startswith("mtp.")]
    )
    full, backbone = load_model(src), load_model(stripped)
    assert backbone.cfg.num_draft_layers == 0 and not any(n.startswith("mtp.") for n in backbone.state_dict())
    ids = torch.tensor([0, 17, 300, 5, 99])
    torch.testing.assert_close(backbone(ids), full(ids), rtol=0, atol=0)
    method = "mtp" if arch == "v4" else "dspark"
    with pytest.raises(
        ValueError, match=f"speculative_method='{method}': this checkpoint has no draft tensors"
    ):
        LLMEngine(backbone, load_tokenizer(stripped), EngineConfig(speculative_method=method))
    partial = _rewrite(
        src, tmp_path / "partial", lambda t: t.pop(sorted(n for n in t if n.startswith("mtp."))[0])
    )
    with pytest.raises(ValueError, match="missing: mtp."):
        load_model(partial)


def test_dspark_tensor_names_of_both_families(tmp_path):
    """V4-0731 layout: markov_w1/w2 and a learned hc_head on the last stage; V4.1: markov_head.embed/head."""
    v4 = set(load_file(write_tiny(tmp_path / "v4", arch="v4-dspark") / SINGLE_FILE))
    v41 = set(load_file(write_tiny(tmp_path / "v41", arch="v41") / SINGLE_FILE))
    v4_only = {
        "mtp.2.markov_head.markov_w1.weight",
        "mtp.2.markov_head.markov_w2.weight",
        "mtp.2.hc_head_fn",
        "mtp.2.hc_head_base",
        "mtp.2.hc_head_scale",
        "mtp.0.main_proj.weight",
    }
    assert v4_only <= v4 and not any("e_proj" in n or "markov_head.embed" in n for n in v4)
    assert {"mtp.2.markov_head.embed.weight", "mtp.2.markov_head.head.weight"} <= v41
    assert not any("markov_w" in n or "hc_head" in n for n in v41)
    v4_experts = {n for n in v4 if n.startswith("mtp.1.ffn.experts.") and n.endswith(".w1.weight")}
    assert len(v4_experts) == 8  # the backbone's experts
