"""Prompt logprobs (``SamplingParams(prompt_logprobs=k)``) against the model's own cache-free forward:
through chunked prefill, next to other requests, after a preemption and on prompts whose prefix the cache
holds; ``RequestOutput.prompt_logprobs`` in vLLM's shape."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM, Logprob
from engine.llm_engine import EngineConfig, LLMEngine
from engine.prompt_logprobs import score_prompt
from engine.request import SamplingParams
from model.checkpoint import load_model
from model.testing.tiny import cached_tiny
from model.tokenizer import load_tokenizer

PAGE = {"v4": 128, "v41": 32}  # the smallest prefix page each tiny model allows
TOL = 1e-5  # fp32
TOP = 3


@pytest.fixture(scope="module", params=["v4", "v41"])
def tiny(request):
    path = cached_tiny(request.param)
    return request.param, path, load_model(path), load_tokenizer(path)


def random_tokens(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(model, prompt: list[int]) -> torch.Tensor:
    """log_softmax of the cache-free forward: row q scores prompt token q + 1."""
    with torch.no_grad():
        return model(torch.tensor(prompt)).float().log_softmax(dim=-1)[:-1]


def rank_fits(rank: int, row: torch.Tensor, token: int) -> bool:
    """``rank`` is the token's under ``row``, up to near-ties within the tolerance."""
    value = float(row[token])
    return int((row > value + TOL).sum()) < rank <= int((row > value - TOL).sum()) + 1


def max_error(scored, prompt: list[int], logp: torch.Tensor) -> float:
    """The largest difference of the token's and the top entries' logprobs to the reference, after checking
    the tokens, ranks and that the top entries are the best ones, best first."""
    assert [p.token for p in scored] == prompt[1:]
    worst = 0.0
    for q, position in enumerate(scored):
        row = logp[q]
        assert rank_fits(position.rank, row, position.token)
        best = row.topk(len(position.top)).values.tolist()
        worst = max(worst, abs(position.logprob - float(row[position.token])))
        for (token, value), expected in zip(position.top, best, strict=True):
            worst = max(worst, abs(value - float(row[token])), abs(value - expected))
    return worst


def engine(model, tokenizer, **config) -> LLMEngine:
    return LLMEngine(model, tokenizer, EngineConfig(**config))


def run(eng: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]):
    requests = [eng.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while eng.has_work:
        eng.step()
    return [eng.completion(r) for r in requests]


def test_score_prompt_is_log_softmax_and_rank():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0], [3.0, -1.0, 0.5, 0.0]])
    first, second = score_prompt(logits, [2, 1], 2)
    logp = logits.log_softmax(dim=-1)
    assert first.token == 2 and first.rank == 3 and abs(first.logprob - float(logp[0, 2])) < 1e-7
    assert [t for t, _ in first.top] in ([1, 3], [3, 1])
    assert second.rank == 4 and second.top[0][0] == 0
    assert score_prompt(logits, [0, 0], 0)[0].top == []


def test_chunked_prefill_next_to_other_requests(tiny):
    """Chunks of 16 tokens shared with a request that asks for none: every position of the 70-token prompt
    scored once, equal to the cache-free forward."""
    arch, _, model, tokenizer = tiny
    eng = engine(model, tokenizer, max_num_batched_tokens=16, enable_prefix_caching=False)
    prompt, other = random_tokens(model.cfg.vocab_size, 70, 1), random_tokens(model.cfg.vocab_size, 40, 2)
    asks = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)
    done = run(eng, [other, prompt], [SamplingParams(max_tokens=4, ignore_eos=True), asks])
    assert done[0].prompt_logprobs is None
    assert max_error(done[1].prompt_logprobs, prompt, reference(model, prompt)) < TOL


def test_preempted_request_keeps_its_scores(tiny):
    """A request preempted mid-prefill and recomputed scores each prompt token exactly once."""
    arch, _, model, tokenizer = tiny
    eng = engine(model, tokenizer, max_num_batched_tokens=16, enable_prefix_caching=False)
    prompt = random_tokens(model.cfg.vocab_size, 50, 3)
    request = eng.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=0))
    eng.step()
    eng.step()
    eng.scheduler._preempt(request)
    while eng.has_work:
        eng.step()
    assert max_error(eng.completion(request).prompt_logprobs, prompt, reference(model, prompt)) < TOL


def test_prefix_cache_hit_is_recomputed_and_published(tiny):
    """A prompt whose prefix the cache holds is computed whole (no hit) when it asks for prompt logprobs,
    and its own pages serve the next request that asks for none."""
    arch, _, model, tokenizer = tiny
    page = PAGE[arch]
    eng = engine(model, tokenizer, prefix_page_size=page, max_num_batched_tokens=1024)
    shared = random_tokens(model.cfg.vocab_size, 2 * page, 4)
    first, second = shared + [5, 6, 7], shared + [8, 9]
    plain = SamplingParams(max_tokens=1, ignore_eos=True)
    asks = SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=TOP)
    run(eng, [first], [plain])
    request = eng.add_request(second, asks)
    while eng.has_work:
        eng.step()
    assert request.num_cached == 0
    assert max_error(eng.completion(request).prompt_logprobs, second, reference(model, second)) < TOL
    third = eng.add_request(second + [10], plain)
    while eng.has_work:
        eng.step()
    assert third.num_cached == 2 * page


def test_llm_returns_vllm_shape(tiny):
    """``RequestOutput.prompt_logprobs``: None, then {id: Logprob(logprob, rank, decoded_token)} with the
    prompt token and the top ones; n > 1 shares them; requests that ask for none get None."""
    arch, path, model, tokenizer = tiny
    llm = LLM(model=path, max_num_batched_tokens=16)
    prompt = random_tokens(model.cfg.vocab_size, 20, 5)
    asks = SamplingParams(max_tokens=2, n=2, prompt_logprobs=TOP)
    out, plain = llm.generate([prompt, prompt], [asks, SamplingParams(max_tokens=2)], use_tqdm=False)
    assert plain.prompt_logprobs is None
    logp = reference(model, prompt)
    lps = out.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    for q, entry in enumerate(lps[1:]):
        token = prompt[q + 1]
        assert next(iter(entry)) == token
        assert len(set(entry) - {token}) in (TOP - 1, TOP)
        for t, lp in entry.items():
            assert isinstance(lp, Logprob)
            assert abs(lp.logprob - float(logp[q, t])) < TOL
            assert rank_fits(lp.rank, logp[q], t)
            assert lp.decoded_token == tokenizer.decode([t], skip_special_tokens=False)


def test_prompt_logprobs_out_of_range_is_refused():
    with pytest.raises(ValueError, match=r"prompt_logprobs=21 must be in \[0, 20\]"):
        SamplingParams(prompt_logprobs=21)
