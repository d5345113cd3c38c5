"""The models in bf16: which tensors stay fp32 (model-spec §9.1), and V4's bf16 logits against the
transformers fp32 oracle, measured beside transformers' own bf16-vs-fp32 distance."""

from __future__ import annotations

import copy
import json
import math
import re

import pytest
import torch

from model.checkpoint import load_model, placement, read_tensors
from model.testing.tiny import cached_tiny
from tests.model.hf_oracle import transformers_model
from tests.model.test_conformance_v4 import oracle_logits, prompt
from triton_kernels import runtime

# model-spec §9.1: mHC, sinks, compressor position bias and gate bias are fp32; norm weights (Engram's
# q/k norms included) are applied in fp32. Every other floating tensor computes in the model's dtype.
FP32_CLASSES = {
    "mhc": r"hc_(attn|ffn|head)_(fn|base|scale)$",
    "sink": r"\.attn_sink$",
    "ape": r"\.ape$",
    "gate bias": r"\.gate\.bias$",
    "norm": r"(norm\.weight|engram\.[qk]_weight)$",
}
# The bf16 classes each architecture must hold, so that every kind is checked.
BF16_CLASSES = {
    "v4": ("embed.weight", "head.weight", ".experts.", ".gate.weight", ".weights_proj.", "mtp.0.e_proj."),
    "v41": ("embed.weight", ".engram.embed.", ".engram.wkv.", ".indexer.wk.", "markov_head", "confidence"),
}


def test_placement_defaults_to_bf16_on_an_accelerator_and_fp32_on_cpu(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(runtime, "backend", lambda: "cpu")
    assert placement() == (cpu, torch.float32)
    assert placement("cpu", "bfloat16") == placement("cpu", torch.bfloat16) == (cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="no npu device"):
        placement("npu")
    with pytest.raises(ValueError, match="dtype='float16'"):
        placement(None, "float16")
    monkeypatch.setattr(runtime, "backend", lambda: "cuda")
    assert placement() == (torch.device("cuda"), torch.bfloat16)
    assert placement("cpu") == (cpu, torch.float32)


def fp32_class(name: str) -> str | None:
    return next((label for label, pattern in FP32_CLASSES.items() if re.search(pattern, name)), None)


@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_bf16_load_keeps_the_spec_fp32_tensors(arch):
    model = load_model(cached_tiny(arch), dtype=torch.bfloat16)
    seen: set[str] = set()
    for name, param in model.named_parameters():
        label = fp32_class(name)
        seen.add(label or "bf16")
        assert param.dtype == (torch.float32 if label else torch.bfloat16), (name, param.dtype)
    names = [n for n, _ in model.named_parameters()]
    expected_fp32 = set(FP32_CLASSES) - ({"ape"} if arch == "v41" else set())  # V4.1 compressors: no ape
    assert seen == expected_fp32 | {"bf16"}
    for part in BF16_CLASSES[arch]:
        assert any(part in n for n in names), part
    state = model.new_state()
    assert state.store.pools.buffer.dtype == torch.bfloat16  # the KV pools follow the compute dtype
    ids = prompt(9, model.cfg.vocab_size)
    with torch.no_grad():
        streams = model.hidden_streams(ids, state) if arch == "v4" else model.run(ids, state).hidden
    assert streams.dtype == torch.bfloat16  # activations too; the logits come out fp32
    assert model(prompt(3, model.cfg.vocab_size)).dtype == torch.float32


def mean_square(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).pow(2).mean().item()


def test_bf16_distance_to_the_fp32_oracle():
    """Acceptance (issue 17): our bf16 logits are no farther from transformers in fp32 than 1.5x
    transformers' own bf16 run, on the same checkpoint and prompts (RMS over every logit, each prompt
    weighing the same).

    Over several prompts, short and long: bf16 rounding can flip a near-tied expert choice at a token,
    which moves its logits by ~10x the rounding itself, in our run or in transformers' (two to four of
    eight short prompts on this model, on either side; which ones depends on the machine's kernels: one
    7-token prompt passed on earlier machines and fails on others). One prompt measures which side flipped;
    many measure the precision: before a flip, our streams stay closer to fp32 than transformers' at every
    layer."""
    path = cached_tiny("v4")
    oracle = transformers_model(json.loads((path / "config.json").read_text()), read_tensors(path))
    oracle_bf16 = copy.deepcopy(oracle).to(torch.bfloat16)
    model = load_model(path, dtype=torch.bfloat16)
    ours, theirs = [], []
    for length in (7, 130):
        for seed in range(1, 5):
            ids = prompt(length, model.cfg.vocab_size, seed)
            reference = oracle_logits(oracle, ids)
            with torch.no_grad():
                ours.append(mean_square(model(ids), reference))
            theirs.append(mean_square(oracle_logits(oracle_bf16, ids), reference))
    ours_rms, theirs_rms = (math.sqrt(sum(d) / len(d)) for d in (ours, theirs))
    print(f"RMS to the fp32 oracle, 8 prompts: ours bf16 {ours_rms:.4f}, transformers bf16 {theirs_rms:.4f}")
    assert ours_rms <= 1.5 * theirs_rms
