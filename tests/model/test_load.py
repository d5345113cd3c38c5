"""The streaming loader: headers checked before any byte is read, each stored tensor read once, and bad
shards refused naming the tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.checkpoint import INDEX_FILE, SINGLE_FILE, load_model, stored_tensors
from model.shards import StoredTensor
from model.testing.tiny import write_tiny


@pytest.fixture(scope="module")
def sharded_fp8(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("sharded"), fp8=True, shards=3)


def _copy(src, dst):
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    return dst


def _count_reads(monkeypatch) -> list[str]:
    reads: list[str] = []
    original = StoredTensor.read_into

    def counted(self, target):
        reads.append(self.name)
        original(self, target)

    monkeypatch.setattr(StoredTensor, "read_into", counted)
    return reads


def test_each_stored_tensor_is_read_once(sharded_fp8, monkeypatch):
    reads = _count_reads(monkeypatch)
    load_model(sharded_fp8)
    stored = stored_tensors(sharded_fp8)
    assert sorted(reads) == sorted(stored)
    files = [stored[name].file for name in reads]
    assert files == sorted(files)  # shard by shard


def test_a_bad_checkpoint_is_refused_before_any_byte_is_read(sharded_fp8, tmp_path, monkeypatch):
    bad = _copy(sharded_fp8, tmp_path / "bad")
    index = json.loads((bad / INDEX_FILE).read_text())
    file = index["weight_map"]["layers.0.attn.wq_a.scale"]
    tensors = load_file(bad / file)
    tensors["layers.0.attn.wq_a.scale"] = tensors["layers.0.attn.wq_a.scale"][:1].contiguous()
    save_file(tensors, bad / file)
    reads = _count_reads(monkeypatch)
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.wq_a\.scale: shape \(1, 4\) does not fit fp8"):
        load_model(bad)
    assert reads == []


def test_a_truncated_shard_names_the_tensor_it_cuts(sharded_fp8, tmp_path):
    bad = _copy(sharded_fp8, tmp_path / "cut")
    shard = sorted(bad.glob("model-*.safetensors"))[1]
    last = max((t for t in stored_tensors(bad).values() if t.file == shard), key=lambda t: t.start)
    shard.write_bytes(shard.read_bytes()[: last.start + 1])
    with pytest.raises(ValueError, match=f"{shard.name} is truncated: tensor {last.name} needs bytes"):
        load_model(bad)
    shard.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_model(bad)


def test_an_index_that_misplaces_a_tensor(sharded_fp8, tmp_path):
    bad = _copy(sharded_fp8, tmp_path / "index")
    index = json.loads((bad / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in index["weight_map"].items() if f == files[0])
    index["weight_map"][name] = files[1]
    (bad / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"index puts tensor {name} in {files[1]}"):
        load_model(bad)


def test_bf16_storage_loads_into_fp32_and_bf16(tmp_path):
    """A dense checkpoint stored bf16 (as released) converts one tensor at a time to the compute dtype."""
    src = write_tiny(tmp_path / "fp32")
    tensors = {
        n: t.to(torch.bfloat16) if t.dtype == torch.float32 else t
        for n, t in load_file(src / SINGLE_FILE).items()
    }
    save_file(tensors, src / SINGLE_FILE)
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(src, dtype=dtype)
        assert torch.equal(model.embed.weight, tensors["embed.weight"].to(dtype))
