"""The ``Engine`` protocol: both engines implement it, and ``stats()`` reports what the engine did."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.config import EngineConfig
from engine.interface import Engine
from engine.llm_engine import LLMEngine
from engine.parallel.data_parallel import DataParallelEngine
from engine.request import SamplingParams
from engine.spec_decode.proposer import ScriptedProposer
from model.checkpoint import load_model
from model.testing.tiny import cached_tiny
from model.tokenizer import load_tokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def parts():
    path = cached_tiny("v4")
    return load_model(path), load_tokenizer(path)


def test_both_engines_implement_the_protocol(parts):
    local = LLMEngine(*parts, EngineConfig())
    assert isinstance(local, Engine)
    assert isinstance(DataParallelEngine(local, SimpleNamespace(world=2)), Engine)


def test_stats_count_the_steps_and_the_cache(parts):
    engine = LLMEngine(*parts, EngineConfig(max_num_batched_tokens=16))
    before = engine.stats()
    assert (before.running, before.kv_usage, before.step_tokens, before.spec_decode) == (0, 0.0, 0, None)
    request = engine.add_request(list(range(2, 22)), GREEDY)
    engine.step()  # the first 16 prompt tokens
    during = engine.stats()
    assert (during.running, during.step_tokens) == (1, 16) and 0 < during.kv_usage <= 1
    assert during.kv_blocks == engine.cache.num_blocks
    while engine.has_work:
        engine.step()
    assert engine.stats().step_tokens == 1 and engine.stats().running == 0  # the last decode
    assert engine.streamed_text(request) == engine.completion(request).text  # no stop string to cut


def test_stats_of_a_speculating_engine_are_a_snapshot(parts):
    config = EngineConfig(num_speculative_tokens=1)
    engine = LLMEngine(*parts, config, ScriptedProposer(lambda request, k: [5] * k))
    engine.add_request([3, 4, 5], GREEDY)
    snapshot = engine.stats().spec_decode
    while engine.has_work:
        engine.step()
    assert snapshot.verify_steps == 0 < engine.stats().spec_decode.verify_steps
