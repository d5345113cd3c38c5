"""Our DeepSeek V4 with every operator on its Triton kernel (interpreted on CPU) against transformers."""

from __future__ import annotations

import json

import pytest
import torch

from model.checkpoint import load_model, read_tensors
from model.testing.tiny import write_tiny
from tests.model.hf_oracle import transformers_model
from triton_kernels import compressor, runtime, sparse_attn

pytestmark = pytest.mark.long  # among the longest test files: scheduled first (tests/conftest.py)

TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny(tmp_path_factory.mktemp("tiny-v4-kernels"))
    oracle = transformers_model(json.loads((path / "config.json").read_text()), read_tensors(path))
    return load_model(path), oracle


def test_logits_match_transformers_with_the_kernels(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    model, oracle = tiny
    ids = torch.randint(3, model.cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = oracle(input_ids=ids[None]).logits[0].float()
    launched: dict[str, list[int]] = {"attention": [], "compressor": []}

    def spy(name: str, launcher):
        def run(*args, **kwargs):
            launched[name].append(args[0].shape[0])
            return launcher(*args, **kwargs)

        return run

    monkeypatch.setattr(
        sparse_attn, "sparse_attention_triton", spy("attention", sparse_attn.sparse_attention_triton)
    )
    monkeypatch.setattr(compressor, "compress_triton", spy("compressor", compressor.compress_triton))
    monkeypatch.setenv("DSV4_TRITON_ON_CPU", "1")
    assert runtime.use_triton(ids)
    # A prefill chunk, a decode step (split + merge attention), then a short chunk over the cached state.
    state, outs, start = model.new_state(), [], 0
    with torch.no_grad():
        for size in (12, 1, 3):
            outs.append(model(ids[start : start + size], state))
            start += size
    diff = (torch.cat(outs) - expected).abs().max().item()
    print(f"kernels: max |logits - transformers| = {diff:.2e}")
    assert diff <= TOL
    assert set(launched["attention"]) == {12, 1, 3} and set(launched["compressor"]) == {12, 1, 3}
