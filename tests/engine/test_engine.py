"""The engine computes exactly what the model computes alone, under chunked prefill and preemption."""

from __future__ import annotations

import pytest
import torch

from engine.llm_engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from model.checkpoint import load_model
from model.generate import greedy
from model.testing.tiny import write_tiny
from model.tokenizer import load_tokenizer

LENGTHS = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 500, 610, 700]
MAX_TOKENS = 3
BUDGET = 48


@pytest.fixture(scope="module", params=["v4", "v41"])
def tiny(request, tmp_path_factory):
    path = write_tiny(tmp_path_factory.mktemp(f"tiny-{request.param}"), arch=request.param)
    return load_model(path), load_tokenizer(path)


def tight_engine(model, tokenizer, slack_blocks: int) -> LLMEngine:
    """An engine whose cache holds the largest request plus ``slack_blocks``: a batch must preempt."""
    probe = LLMEngine(model, tokenizer, EngineConfig(max_num_batched_tokens=BUDGET))
    peak = probe.cache.max_blocks(max(LENGTHS) + MAX_TOKENS, BUDGET)
    memory = (peak + slack_blocks) * probe.cache.block_bytes
    return LLMEngine(model, tokenizer, EngineConfig(max_num_batched_tokens=BUDGET, kv_cache_memory=memory))


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


def run(engine: LLMEngine, batch: list[list[int]], params: SamplingParams) -> list[list[int]]:
    requests = [engine.add_request(p, params) for p in batch]
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        assert steps < 5000
    assert engine.cache.num_free == engine.cache.num_blocks  # nothing leaked
    return [engine.completion(r).token_ids for r in requests]


def test_batch_equals_cache_free_greedy_and_each_prompt_alone(tiny):
    model, tokenizer = tiny
    engine = tight_engine(model, tokenizer, slack_blocks=0)
    batch = prompts(model.cfg.vocab_size)
    greedy_params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    outputs = run(engine, batch, greedy_params)
    assert engine.scheduler.preemptions > 0, "the cache was meant to force preemption"
    for prompt, out in zip(batch, outputs, strict=True):
        assert out == greedy(model, prompt, MAX_TOKENS, use_cache=False)
    cfg, cache = model.cfg, engine.cache
    print(f"{cfg.model_type}: {engine.scheduler.preemptions} preemptions, cache of {cache.num_blocks} blocks")
    alone = tight_engine(model, tokenizer, slack_blocks=0)
    for prompt, out in zip(batch, outputs, strict=True):
        assert run(alone, [prompt], greedy_params) == [out]


def test_seeded_sampling_does_not_depend_on_the_batch(tiny):
    model, tokenizer = tiny
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_batched_tokens=BUDGET))
    batch = prompts(model.cfg.vocab_size)[:6]
    seeded = SamplingParams(max_tokens=4, temperature=1.0, top_p=0.9, seed=42)
    together = run(engine, batch, seeded)
    assert run(engine, [batch[3]], seeded) == [together[3]]
    assert run(engine, batch[2:5][::-1], seeded)[1] == together[3]


def test_requests_that_can_never_run_are_rejected(tiny):
    model, tokenizer = tiny
    engine = LLMEngine(model, tokenizer, EngineConfig(max_model_len=64, kv_cache_memory=8 * 2**20))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request([5] * 60, SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([5, -1], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    small = LLMEngine(model, tokenizer, EngineConfig(kv_cache_memory=engine.cache.block_bytes * 2))
    with pytest.raises(ValueError, match="KV cache blocks"):
        small.add_request([5] * 600, SamplingParams(max_tokens=5))
    assert not engine.has_work and not small.has_work


def test_stop_strings_eos_and_abort(tiny):
    model, tokenizer = tiny
    engine = LLMEngine(model, tokenizer, EngineConfig())
    prompt = prompts(model.cfg.vocab_size)[6]
    free_run = run(engine, [prompt], SamplingParams(max_tokens=8, temperature=0.0))[0]
    text = tokenizer.decode(free_run, skip_special_tokens=True)
    stop = text[3:6]
    request = engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.0, stop=(stop,)))
    while engine.has_work:
        engine.step()
    done = engine.completion(request)
    assert done.finish_reason == "stop" and stop not in done.text and text.startswith(done.text)
    request = engine.add_request(
        prompt,
        SamplingParams(max_tokens=8, temperature=0.0, stop=("\x00", stop), include_stop_str_in_output=True),
    )
    while engine.has_work:
        engine.step()
    kept = engine.completion(request)  # vLLM's include_stop_str_in_output: cut after the stop string
    assert kept.finish_reason == "stop" and kept.text == done.text + stop
    stopped = run(
        engine, [prompt], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(free_run[1],))
    )
    assert stopped[0] == free_run[:2]
    request = engine.add_request(prompt, SamplingParams(max_tokens=50))
    engine.step()
    engine.abort(request.id)
    assert request.finish_reason.value == "abort" and not engine.has_work
    assert engine.cache.num_free == engine.cache.num_blocks
