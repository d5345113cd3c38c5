"""One request that fails in a step fails alone: its batch-mates complete with the output they have
without it, and the engine keeps serving."""

from __future__ import annotations

import pytest
import torch

from engine.llm_engine import EngineConfig, LLMEngine
from engine.request import FinishReason, Request, SamplingParams
from model.checkpoint import load_model
from model.testing.tiny import write_tiny
from model.tokenizer import load_tokenizer

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    path = write_tiny(tmp_path_factory.mktemp("tiny-v41"), arch="v41")
    return LLMEngine(load_model(path), load_tokenizer(path), EngineConfig(max_num_batched_tokens=64))


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 17, 40, 9)]


def run(engine: LLMEngine, requests: list[Request]) -> None:
    for _ in range(500):
        if not engine.has_work:
            break
        engine.step()
    assert not engine.has_work
    assert engine.cache.num_free == engine.cache.num_blocks  # nothing leaked, the failed request included


def raising_after(calls: int):
    seen = 0

    def processor(output: list[int], logits: torch.Tensor) -> torch.Tensor:
        nonlocal seen
        seen += 1
        if seen > calls:
            raise RuntimeError("grammar state broken")
        return logits

    return processor


def masking_everything(output: list[int], logits: torch.Tensor) -> torch.Tensor:
    return torch.full_like(logits, float("-inf"))


@pytest.mark.parametrize(
    ("poison", "params"),
    [
        (raising_after(0), GREEDY),  # fails in its first sampling step
        (raising_after(3), SAMPLED),  # fails mid-decode
        (masking_everything, SAMPLED),  # no token left to draw
        (masking_everything, GREEDY),
    ],
    ids=["raises at once", "raises mid-decode", "masks every token (sampled)", "masks every token (greedy)"],
)
def test_a_failing_request_fails_alone(engine: LLMEngine, poison, params: SamplingParams):
    batch = prompts(engine.model.cfg.vocab_size)
    clean = [engine.add_request(p, params) for p in batch]
    run(engine, clean)
    expected = [engine.completion(r).token_ids for r in clean]

    good = [engine.add_request(p, params) for p in batch]
    bad = engine.add_request(batch[1], params)
    bad.logits_processor = poison
    run(engine, [*good, bad])
    assert [engine.completion(r).token_ids for r in good] == expected
    failed = engine.completion(bad)
    assert failed.finish_reason == FinishReason.ERROR.value
    assert bad.error and "failed in the engine" in bad.error

    after = engine.add_request(batch[0], params)  # the engine keeps serving
    run(engine, [after])
    assert engine.completion(after).token_ids == expected[0]
