"""Checkpoint loading: strict names and shapes, FP8 block scales, and bad token ids."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.checkpoint import SINGLE_FILE, load_model
from model.quant import dequantize_fp4, dequantize_fp8, quantize_fp4, quantize_fp8
from model.tiny import write_tiny


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("tiny"))


def _rewrite(src, dst, edit):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / SINGLE_FILE)
    edit(tensors)
    save_file(tensors, dst / SINGLE_FILE)
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
