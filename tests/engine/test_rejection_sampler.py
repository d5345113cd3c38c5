"""Verifying drafts: greedy keeps the prefix the target agrees with; sampling is lossless (chi-square)."""

from __future__ import annotations

import pytest
import torch

from engine.request import Proposal, Request, SamplingParams
from engine.sampler import Sampler, filtered_probs

V = 6
GEN = torch.Generator().manual_seed(5)
TARGET = torch.randn(3, V, generator=GEN) * 1.5  # p_0, p_1 (after draft 0), p_2 (bonus)
DRAFT = torch.randn(2, V, generator=GEN) * 1.5  # q_0, q_1


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(X >= statistic) for a chi-square with len - 1 degrees of freedom (cells with probability > 0)."""
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    expected = probs[keep] * counts.sum()
    statistic = ((counts[keep] - expected) ** 2 / expected).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), statistic / 2.0))


def test_greedy_keeps_the_agreeing_prefix_then_the_target_token():
    target = torch.zeros(4, V)
    target[torch.arange(4), torch.tensor([2, 5, 1, 3])] = 1.0
    request = Request([0], SamplingParams(temperature=0.0))
    sampler = Sampler()
    assert [t for t, _ in sampler(request, target, Proposal([2, 5, 1]))] == [2, 5, 1, 3]  # bonus
    assert [t for t, _ in sampler(request, target, Proposal([2, 4, 1]))] == [2, 5]  # correction
    assert [t for t, _ in sampler(request, target[:1], Proposal([2, 4, 1]))] == [2]  # no drafts verified


def test_greedy_verification_sees_the_penalties_of_the_accepted_drafts():
    target = torch.tensor([[0.0, 3.0, 2.9, 0, 0, 0], [0.0, 3.0, 2.9, 0, 0, 0]])
    request = Request([0], SamplingParams(temperature=0.0, presence_penalty=1.0))
    # Draft 1 is right at position 0; at position 1 token 1 is penalised (already output), so 2 wins.
    assert [t for t, _ in Sampler()(request, target, Proposal([1, 1]))] == [1, 2]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4)]
)
def test_rejection_sampling_reproduces_the_target_distribution(params, deterministic):
    """Over many seeded trials the first token follows p_0 and, after an accepted draft 0, the second
    follows p_1, whether the drafts are drawn from q or proposed deterministically."""
    trials = 12000
    sampler = Sampler(seed=1)
    first, second = torch.zeros(V), torch.zeros(V)
    accepted = 0
    for i in range(trials):
        request = Request([0], SamplingParams(**{**vars(params), "seed": i}))
        if deterministic:  # the target's likeliest tokens, proposed without a distribution
            proposal = Proposal(TARGET.argmax(dim=1)[:2].tolist())
        else:
            drafts: list[int] = []
            for row in DRAFT:
                drafts.append(sampler.draft(request, row, drafts))
            proposal = Proposal(drafts, DRAFT)
        tokens = [t for t, _ in sampler(request, TARGET, proposal)]
        first[tokens[0]] += 1
        if tokens[0] == proposal.tokens[0]:
            accepted += 1
            second[tokens[1]] += 1
    assert accepted > 500  # enough second tokens to test
    assert chi_square_pvalue(first, filtered_probs(TARGET[0], params)) > 1e-3
    assert chi_square_pvalue(second, filtered_probs(TARGET[1], params)) > 1e-3


def test_the_chi_square_test_rejects_a_wrong_distribution():
    """The statistic has power: counts drawn from q are not accepted as p."""
    params = SamplingParams(temperature=1.0)
    q = filtered_probs(DRAFT[0], params)
    counts = torch.bincount(torch.multinomial(q, 12000, replacement=True, generator=GEN), minlength=V)
    assert chi_square_pvalue(counts.float(), filtered_probs(TARGET[0], params)) < 1e-6


def test_seeded_speculative_sampling_is_reproducible():
    request = Request([0], SamplingParams(temperature=1.0, seed=42))
    runs = []
    for _ in range(2):
        sampler = Sampler()
        drafts = [sampler.draft(request, row, []) for row in DRAFT[:1]]
        runs.append([sampler(request, TARGET[:2], Proposal(drafts, DRAFT[:1])) for _ in range(20)])
    assert runs[0] == runs[1]


def test_bad_verification_input():
    request = Request([0], SamplingParams(temperature=0.0))
    with pytest.raises(ValueError, match="logit rows"):
        Sampler()(request, TARGET, Proposal([1]))
    request.logits_processor = lambda output, logits: logits
    with pytest.raises(ValueError, match="logits processor"):
        Sampler()(request, TARGET[:2], Proposal([1]))
