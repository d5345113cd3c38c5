"""Our DeepSeek V4 against transformers' ``DeepseekV4ForCausalLM`` on the tiny checkpoint (fp32)."""

from __future__ import annotations

import json

import pytest
import torch

from model.attention import Indexer
from model.checkpoint import dequantize, load_model, read_tensors
from model.generate import greedy
from model.plan import Attention
from model.testing.tiny import write_tiny
from tests.model.hf_oracle import transformers_model

TOL = 1e-4
NEAR_TIE = 1e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny(tmp_path_factory.mktemp("tiny-v4"), shards=2)
    model = load_model(path)
    oracle = transformers_model(json.loads((path / "config.json").read_text()), read_tensors(path))
    return path, model, oracle


def prompt(length: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed))


def oracle_logits(oracle, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return oracle(input_ids=ids[None]).logits[0].float()


class NearTies:
    """Records indexer queries whose k-th and (k+1)-th scores are closer than NEAR_TIE (relative)."""

    def __init__(self, model):
        self.found: list[tuple[int, int, float]] = []
        self.handles = [
            m.register_forward_hook(self._hook) for m in model.modules() if isinstance(m, Indexer)
        ]

    def _hook(self, module, args, output):
        scores = module.scores(*args)  # only used on the cache-free path: recomputing is exact
        if scores.shape[1] <= module.topk:
            return
        top = scores.topk(module.topk + 1, dim=-1).values
        kth, next_ = top[:, -2], top[:, -1]
        gap = (kth - next_) / kth.abs().clamp_min(1e-30)
        for t in torch.nonzero(torch.isfinite(next_) & (gap < NEAR_TIE)).flatten().tolist():
            self.found.append((id(module), t, float(gap[t])))

    def close(self):
        for h in self.handles:
            h.remove()


def test_tiny_exercises_every_layer_kind(tiny):
    _, model, _ = tiny
    kinds = {p.attention for p in model.plan if not p.is_draft}
    assert kinds == {Attention.SLIDING, Attention.CSA, Attention.HCA}
    assert any(p.hash_moe for p in model.plan) and any(not p.hash_moe for p in model.plan)


@pytest.mark.parametrize("length", [1, 7, 130, 300])
def test_logits_match_transformers(tiny, length):
    _, model, oracle = tiny
    ids = prompt(length, model.cfg.vocab_size)
    ties = NearTies(model)
    with torch.no_grad():
        ours = model(ids)
    ties.close()
    assert not ties.found, f"indexer near-ties (module, query, relative gap): {ties.found}"
    diff = (ours - oracle_logits(oracle, ids)).abs().max().item()
    print(f"length {length}: max |logits - transformers| = {diff:.2e}")
    assert diff <= TOL


def test_incremental_prefill_matches_transformers(tiny):
    _, model, oracle = tiny
    ids = prompt(300, model.cfg.vocab_size, seed=2)
    state, chunks, start = model.new_state(), [1, 3, 4, 5, 31, 128, 2, 126], 0
    outs = []
    with torch.no_grad():
        for size in chunks:
            outs.append(model(ids[start : start + size], state))
            start += size
    assert start == ids.shape[0] and state.num_tokens == 300
    diff = (torch.cat(outs) - oracle_logits(oracle, ids)).abs().max().item()
    print(f"chunked prefill: max |logits - transformers| = {diff:.2e}")
    assert diff <= TOL


def test_greedy_incremental_equals_cache_free(tiny):
    _, model, oracle = tiny
    ids = prompt(300, model.cfg.vocab_size, seed=3).tolist()
    cached = greedy(model, ids, 32, use_cache=True)
    fresh = greedy(model, ids, 32, use_cache=False)
    assert cached == fresh
    assert len(cached) == 32 or cached[-1] == model.cfg.eos_token_id
    full = torch.tensor(ids + cached[:-1])
    assert oracle_logits(oracle, full)[len(ids) - 1 :].argmax(-1).tolist() == cached


def test_swiglu_clamp_is_hit(tiny):
    _, model, _ = tiny
    hits = []

    def routed_gate(mod, args, out):  # the w1 projection of each token's chosen experts, before the clamp
        x, picked = args[0].float(), args[1]
        hits.append(bool((torch.einsum("tjid,td->tji", mod.w1[picked].float(), x) > 10.0).any()))

    hooks = [layer.ffn.experts.register_forward_hook(routed_gate) for layer in model.layers]
    with torch.no_grad():
        model(prompt(64, model.cfg.vocab_size))
    for h in hooks:
        h.remove()
    assert any(hits)


def test_quantised_checkpoint_matches_dequantised_weights(tmp_path, tiny):
    """FP8 linears and MXFP4 experts load within their rounding of the fp32 weights, and the model
    on them still matches transformers run on the same dequantised weights."""
    _, model, _ = tiny
    path = write_tiny(tmp_path / "fp8", fp8=True)
    stored = read_tensors(path)
    fp8 = {n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn}
    fp4 = {n for n, t in stored.items() if t.dtype == torch.int8}
    assert fp8 and fp4 and all(n.removesuffix(".weight") + ".scale" in stored for n in fp8 | fp4)
    assert all(".experts." in n for n in fp4)
    quantised = load_model(path)
    ref = dict(model.named_parameters())
    for name, param in quantised.named_parameters():
        # E4M3 keeps 3 mantissa bits; E2M1 over a power-of-two group scale is within a third of the max.
        share = 0.07 if name in fp8 else 0.34 if name in fp4 else 0.0
        assert (param - ref[name]).abs().max().item() <= share * ref[name].abs().max().item(), name
    ids = prompt(130, model.cfg.vocab_size)
    dequantised = dequantize(stored, 32, torch.float32)
    oracle = transformers_model(json.loads((path / "config.json").read_text()), dequantised)
    with torch.no_grad():
        diff = (quantised(ids) - oracle_logits(oracle, ids)).abs().max().item()
    print(f"fp8/fp4: max |logits - transformers on dequantised weights| = {diff:.2e}")
    assert diff <= TOL
