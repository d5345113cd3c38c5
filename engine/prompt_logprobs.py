"""Prompt logprobs (vLLM's ``prompt_logprobs``): how likely the model finds each prompt token given the
ones before it, scored in the prefill that computes the prompt anyway.

The logits at position ``q`` score prompt token ``q + 1``, so a request asking for them has the rows of
its prompt positions ``0 .. len(prompt) - 2`` projected through the LM head as its chunks run (only
these requests' rows: the head costs ``rows x vocab``); the first prompt token has no entry. A request
asking for them takes no prefix-cache hit until they are all computed (a hit would skip the rows of the
cached positions): it recomputes the prompt, and still publishes its pages for others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

ROWS_PER_SLICE = 256  # rows turned into logprobs at once: bounds the fp32 copies of [rows, vocab]


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt token's logprob and rank (1 = the model's most likely token) at its position, and the
    ``k`` most likely tokens there, best first (token ``i`` of ``top`` has rank ``i + 1``)."""

    token: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]

    def entries(self) -> dict[int, float]:
        """The token's logprob and the top ones by token id (the token first), as sampled logprobs are."""
        return {self.token: self.logprob, **dict(self.top)}


def score_prompt(logits: torch.Tensor, targets: list[int], k: int) -> list[PromptLogprob]:
    """``targets[i]``'s logprob and rank under ``logits[i]`` (``[n, V]``), with the ``k`` best of each row;
    log_softmax in fp32."""
    out: list[PromptLogprob] = []
    wanted = torch.tensor(targets, dtype=torch.long, device=logits.device)
    for rows, tokens in zip(logits.split(ROWS_PER_SLICE), wanted.split(ROWS_PER_SLICE), strict=True):
        logp = rows.float().log_softmax(dim=-1)
        chosen = logp.gather(1, tokens[:, None])
        ranks = (logp > chosen).sum(dim=-1) + 1
        best = logp.topk(k, dim=-1)
        for token, value, rank, ids, values in zip(
            tokens.tolist(), chosen[:, 0].tolist(), ranks.tolist(),
            best.indices.tolist(), best.values.tolist(), strict=True,
        ):  # fmt: skip
            out.append(PromptLogprob(token, value, rank, list(zip(ids, values, strict=True))))
    return out


@dataclass(frozen=True)
class Logprob:
    """vLLM's: a token's logprob, its rank under the model (1: the most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def as_vllm(scored: list[PromptLogprob], tokenizer: Tokenizer) -> list[dict[int, Logprob] | None]:
    """vLLM's ``RequestOutput.prompt_logprobs``: None for the first prompt token, then per token a dict of
    the token itself and the top ones, by id."""
    texts: dict[int, str] = {}

    def entry(token: int, logprob: float, rank: int) -> Logprob:
        if token not in texts:
            texts[token] = tokenizer.decode([token], skip_special_tokens=False)
        return Logprob(logprob, rank, texts[token])

    out: list[dict[int, Logprob] | None] = [None]
    for position in scored:
        logprobs = {position.token: entry(position.token, position.logprob, position.rank)}
        for rank, (token, logprob) in enumerate(position.top, 1):
            logprobs.setdefault(token, entry(token, logprob, rank))
        out.append(logprobs)
    return out
