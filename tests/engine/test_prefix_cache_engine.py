"""Prefix-cache hits through the engine: the same logits as a cold run chunked at the boundary, hit
lengths as the write side predicts (also when speculating), shared blocks never written, and the
compressors resume exactly from a boundary's saved rows."""

from __future__ import annotations

import random

import pytest
import torch

from engine.llm_engine import EngineConfig, LLMEngine
from engine.request import Request, SamplingParams
from model.cache import SavedCompressor
from model.checkpoint import load_model
from model.compressor import Compressor
from model.testing.tiny import cached_tiny
from model.tokenizer import load_tokenizer

PAGE = {"v4": 128, "v4-dspark": 128, "v41": 32}  # the smallest page each tiny model allows
SPECULATION = {"v4": "mtp", "v41": "dspark"}


@pytest.fixture(scope="module", params=["v4", "v41"])
def tiny(request):
    path = cached_tiny(request.param)
    return request.param, load_model(path), load_tokenizer(path)


def engine(tiny, **config) -> LLMEngine:
    arch, model, tokenizer = tiny
    config = {"prefix_page_size": PAGE[arch], "max_num_batched_tokens": 1024, **config}
    return LLMEngine(model, tokenizer, EngineConfig(**config))


def random_tokens(model, n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.cfg.vocab_size, (n,), generator=gen).tolist()


def run(engine: LLMEngine, prompt: list[int], max_tokens: int = 3, preempt_after: int | None = None):
    """Greedy output, the logits of each sampled token, and the tokens the prefix cache gave."""
    logits: list[torch.Tensor] = []

    def keep(_: list[int], row: torch.Tensor) -> torch.Tensor:
        logits.append(row.clone())
        return row

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request: Request = engine.add_request(prompt, params)
    request.logits_processor = keep
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        if steps == preempt_after and not request.finished:
            engine.scheduler._preempt(request)
    assert engine.cache.num_free == engine.cache.num_blocks  # nothing leaked
    return engine.completion(request).token_ids, logits, request.num_cached


def cached_blocks(engine: LLMEngine) -> dict[int, torch.Tensor]:
    """Every block a cached page or checkpoint holds, with its contents as bytes (an int8 cache's codes and
    scales read as floats may be NaN, which no float comparison finds equal)."""
    pages = engine.cache.prefix.pages.values()
    blocks = {b for p in pages for held in p.blocks.values() for b in held}
    blocks |= {b for p in pages if p.checkpoint for b in p.checkpoint.window_blocks}
    return {b: engine.runner.pools.buffer[b].view(torch.uint8).clone() for b in blocks}


def test_a_page_size_off_the_model_is_refused_at_start(tiny):
    arch, model, _ = tiny
    bad = PAGE[arch] // 2 if arch == "v4" else model.cfg.sliding_window - 2  # below a ratio / the window
    with pytest.raises(ValueError, match=f"page size {bad} must be a multiple"):
        engine(tiny, prefix_page_size=bad)
    assert engine(tiny, enable_prefix_caching=False).cache.prefix is None


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_hit_gives_the_logits_of_a_cold_run_chunked_at_the_boundary(tiny, kv_cache_dtype):
    """Also over an int8 cache: a row's codes depend on that row alone, a hit reads what a cold run writes."""
    arch, model, _ = tiny
    page = PAGE[arch]
    shared = random_tokens(model, 2 * page + 40, seed=1)
    warm = engine(tiny, kv_cache_dtype=kv_cache_dtype)
    run(warm, shared[: 2 * page + 5])  # its prefill stops on 2P, where the checkpoint is saved
    before = cached_blocks(warm)
    prompt = shared[: 2 * page + 9] + random_tokens(model, 11, seed=2)
    hit_out, hit_logits, hit = run(warm, prompt)
    cold_out, cold_logits, cold_hit = run(engine(tiny, kv_cache_dtype=kv_cache_dtype), prompt)
    assert (hit, cold_hit) == (2 * page, 0)
    assert hit_out == cold_out
    assert all(torch.equal(a, b) for a, b in zip(hit_logits, cold_logits, strict=True))
    after = {b: warm.runner.pools.buffer[b].view(torch.uint8) for b in before}
    assert all(torch.equal(before[b], after[b]) for b in before), "a write landed in a shared block"


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_preempted_request_resumes_from_its_own_checkpoint(tiny, kv_cache_dtype):
    arch, model, _ = tiny
    prompt = random_tokens(model, PAGE[arch] + 20, seed=3)
    cold = engine(tiny, enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    cold_out, _, _ = run(cold, prompt, max_tokens=8)
    warm = engine(tiny, kv_cache_dtype=kv_cache_dtype)
    out, _, hit = run(warm, prompt, max_tokens=8, preempt_after=4)
    assert warm.scheduler.preemptions == 1 and warm.scheduler.prefix_hits == PAGE[arch]
    assert hit == 0 and out == cold_out


def test_hit_length_sweep_is_the_largest_checkpoint_below_the_shared_prefix(tiny):
    arch, model, _ = tiny
    page, rng = PAGE[arch], random.Random(4)
    base = random_tokens(model, max(2 * page, 128) + 40, seed=5)
    warm = engine(tiny)
    registered = set()
    for n in (page + 2, 2 * page + 4):  # a prompt's checkpoint: its last page boundary before its last token
        run(warm, base[:n], max_tokens=1)
        registered.add((n - 1) // page * page)
    shared = sorted({s for k in (1, 2) for s in (k * page - 1, k * page, k * page + 1)} | {127, 128, 129})
    for i, s in enumerate(s for s in shared if s < len(base)):
        tail = random_tokens(model, rng.randrange(1, 40), seed=100 + i)
        tail[0] = (base[s] + 1) % model.cfg.vocab_size  # diverges right after s
        prompt = base[:s] + tail
        expected = max((b for b in registered if b <= min(s, len(prompt) - 1)), default=0)
        _, _, hit = run(warm, prompt, max_tokens=1)
        assert hit == expected, f"shared {s} of {len(prompt)}: hit {hit}, expected {expected}"
        if (len(prompt) - 1) // page * page <= s:  # this prompt's own checkpoint lies in the shared part
            registered.add((len(prompt) - 1) // page * page)
    inside_first = list(base[: 2 * page + 4])
    inside_first[page // 2] += 1
    assert run(warm, inside_first, max_tokens=1)[2] == 0
    assert warm.cache._reclaim(warm.cache.num_blocks) and warm.cache.prefix.num_pages() == 0
    assert run(warm, base[: 2 * page + 4], max_tokens=1)[2] == 0


def test_speculation_registers_the_boundaries_its_steps_stop_on(tiny):
    """Decoding past page boundaries with drafts: every boundary the request passed is a checkpoint a
    later prompt hits, and the hit run's greedy output is the cold run's."""
    arch, model, _ = tiny
    page = PAGE[arch]
    prompt = random_tokens(model, page - 7, seed=6)
    spec = {"speculative_method": SPECULATION[arch], "num_speculative_tokens": 3}
    warm = engine(tiny, **spec)
    out, _, _ = run(warm, prompt, max_tokens=page + 10 if arch == "v41" else 12)  # past 2P / P
    tokens = prompt + out
    # Computed positions reach len(tokens) - 1; the step that finished it saves no checkpoint.
    boundaries = range(page, len(tokens) - 1, page)
    assert {p.end for p in warm.cache.prefix.pages.values() if p.checkpoint} == set(boundaries)
    for b in boundaries:
        probe = tokens[:b] + random_tokens(model, 5, seed=b)
        stats = warm.spec_stats.accepted
        hit_out, _, hit = run(warm, probe, max_tokens=6)
        cold = engine(tiny, **spec)
        cold_out, _, _ = run(cold, probe, max_tokens=6)
        assert hit == b and hit_out == cold_out
        if arch == "v4":  # the MTP layer's window is cached too: it drafts exactly as the cold run
            assert warm.spec_stats.accepted - stats == cold.spec_stats.accepted


@pytest.mark.parametrize(
    ("ratio", "overlap", "ape"), [(4, True, True), (128, False, True), (2, False, False), (1, False, False)]
)
def test_compressors_resume_from_a_boundary_exactly(ratio, overlap, ape):
    torch.manual_seed(ratio)
    compressor = Compressor(32, 16, ratio, 1e-6, overlap=overlap, ape=ape)
    for p in compressor.parameters():
        torch.nn.init.normal_(p, std=0.5)
    n, boundary = 3 * 128 + 7, 2 * 128
    x = torch.randn(n, 32)
    with torch.no_grad():
        whole, _ = compressor.pool(x, compressor.new_state(x.device))
        live = compressor.new_state(x.device)
        head, _ = compressor.pool(x[:boundary], live)
        restored = SavedCompressor.of(live).restore(boundary)
        resumed, first = compressor.pool(x[boundary:], restored)
        continued, _ = compressor.pool(x[boundary:], live)
    assert first == boundary // ratio and torch.equal(resumed, continued)
    torch.testing.assert_close(torch.cat([head, resumed]), whole, rtol=1e-5, atol=1e-5)
    if ratio > 1:  # off a window boundary the open window's rows would be lost
        partial = compressor.new_state(x.device)
        with torch.no_grad():
            compressor.pool(x[: boundary + 1], partial)
        with pytest.raises(ValueError, match="open window"):
            SavedCompressor.of(partial)
