"""Prompt logprobs under tensor parallel (every rank projects the same rows through its head shard, the
logits gathered) and data parallel (each rank scores its own requests, the front collects them): equal
to the model's cache-free forward, through chunked prefill."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.request import SamplingParams
from model.checkpoint import load_model
from model.testing.tiny import cached_tiny

# Three prompts over chunks of 16: data parallel spreads them over both ranks.
PROMPTS = [list(range(2, 42)), [0, 911, 37, 5], list(range(100, 130))]
ENGINE = {"max_num_batched_tokens": 16, "max_model_len": 128, "block_size": 16}
ASKS = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=2)
TOL = 1e-5  # fp32; the ranks' partial sums are added in fp32


def max_error(llm: LLM, model) -> float:
    worst = 0.0
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, ASKS, use_tqdm=False), strict=True):
        with torch.no_grad():
            logp = model(torch.tensor(prompt)).float().log_softmax(dim=-1)
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for q, entry in enumerate(out.prompt_logprobs[1:]):
            assert prompt[q + 1] in entry and len(entry) >= 2
            worst = max([worst, *(abs(lp.logprob - float(logp[q, t])) for t, lp in entry.items())])
    return worst


@pytest.mark.parametrize(
    "parallel",
    [{"tensor_parallel_size": 2}, {"data_parallel_size": 2, "enable_expert_parallel": True}],
    ids=["tp2", "dp2"],
)
def test_prompt_logprobs_over_two_ranks(parallel: dict):
    path = cached_tiny("v41")
    llm = LLM(model=path, **parallel, **ENGINE)
    try:
        assert max_error(llm, load_model(path)) < TOL
    finally:
        llm.close()
