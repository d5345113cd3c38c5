"""Sampling: filters, penalties, logprobs and per-request seeded reproducibility."""

from __future__ import annotations

import pytest
import torch

from engine.request import Request, SamplingParams
from engine.sampler import Sampler, filtered_probs, penalize, top_logprobs

LOGITS = torch.log(torch.tensor([0.05, 0.1, 0.15, 0.3, 0.4]))


def test_top_k_top_p_min_p():
    probs = filtered_probs(LOGITS, SamplingParams(top_k=2))
    assert torch.allclose(probs, torch.tensor([0, 0, 0, 3 / 7, 4 / 7]))
    probs = filtered_probs(LOGITS, SamplingParams(top_p=0.65))  # 0.4 + 0.3 reach 0.65
    assert (probs > 0).tolist() == [False, False, False, True, True]
    probs = filtered_probs(LOGITS, SamplingParams(min_p=0.5))  # keeps p >= 0.2
    assert (probs > 0).tolist() == [False, False, False, True, True]
    probs = filtered_probs(LOGITS, SamplingParams(temperature=2.0))
    assert torch.allclose(probs, torch.softmax(LOGITS / 2, 0))


def test_penalties():
    request = Request([0, 3], SamplingParams(), output=[4, 4])
    logits = torch.tensor([1.0, 1.0, 1.0, -1.0, 2.0])
    out = penalize(logits, request.prompt, request.output, SamplingParams(repetition_penalty=2.0))
    assert out.tolist() == [0.5, 1.0, 1.0, -2.0, 1.0]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = penalize(logits, request.prompt, request.output, params)
    assert out.tolist() == [1.0, 1.0, 1.0, -1.0, 1.0]


def test_logprobs_are_the_model_distribution():
    got = top_logprobs(LOGITS, 0, 2)
    assert set(got) == {0, 4, 3} and got[4] == pytest.approx(float(torch.log(torch.tensor(0.4))))
    assert top_logprobs(LOGITS, 1, None) is None


def test_seeded_requests_sample_the_same_whatever_the_batch():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))

    def run(batch_size: int, position: int) -> list[int]:
        sampler = Sampler(seed=batch_size)
        requests = [Request([1], SamplingParams(temperature=1.0, seed=i + 100)) for i in range(batch_size)]
        target = Request([1], SamplingParams(temperature=1.0, seed=7))
        requests.insert(position, target)
        tokens = []
        for _ in range(20):
            out = [sampler(r, logits) for r in requests]
            tokens.append(out[position][0][0])
        return tokens

    assert run(1, 0) == run(5, 3) == run(3, 1)


def test_greedy_ignores_temperature_filters():
    sampler = Sampler()
    request = Request([1], SamplingParams(temperature=0.0, top_k=1, logprobs=1))
    [(token, logprobs)] = sampler(request, LOGITS[None])
    assert token == 4 and set(logprobs) == {4}


@pytest.mark.parametrize(
    "bad",
    [
        {"max_tokens": 0},
        {"temperature": -1},
        {"top_p": 0},
        {"top_k": -1},
        {"min_p": 2},
        {"logprobs": 21},
        {"stop": ("",)},
        {"stop_token_ids": (-1,)},
        {"repetition_penalty": 0},
    ],
)
def test_bad_params(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        SamplingParams(**bad)


def test_logits_processor_sees_the_output_and_masks_before_sampling():
    seen = []

    def only_token_1(output: list[int], logits: torch.Tensor) -> torch.Tensor:
        seen.append(list(output))
        return torch.full_like(logits, float("-inf")).index_fill(0, torch.tensor([1]), 0.0)

    sampled = Request([0], SamplingParams(temperature=1.0, seed=3), output=[2], logits_processor=only_token_1)
    greedy = Request([0], SamplingParams(temperature=0.0, logprobs=1), logits_processor=only_token_1)
    sampler = Sampler()
    out = [sampler(r, LOGITS[None])[0] for r in (sampled, greedy)]
    assert [token for token, _ in out] == [1, 1]
    assert seen == [[2], []]
    assert out[1][1] == top_logprobs(LOGITS, 1, 1)  # logprobs stay those of the model


def test_a_vanishing_temperature_samples_greedily():
    request = Request([0], SamplingParams(temperature=1e-308))
    assert Sampler()(request, LOGITS[None])[0][0] == int(LOGITS.argmax())
