"""Next-token sampling for a batch of requests.

Penalties, then the request's logits processor (constrained decoding), then temperature, top-k, top-p
and min-p, then a draw from each request's own generator, so a seeded request samples the same tokens
whatever batch it lands in.
"""

from __future__ import annotations

import torch

from engine.request import Request, SamplingParams


class Sampler:
    def __init__(self, seed: int = 0):
        self._seeds = torch.Generator().manual_seed(seed)  # seeds requests that bring none
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request: Request) -> None:
        self._generators.pop(request.id, None)

    def generator(self, request: Request) -> torch.Generator:
        if request.id not in self._generators:
            seed = request.params.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seeds))
            self._generators[request.id] = torch.Generator().manual_seed(seed)
        return self._generators[request.id]

    def __call__(
        self, logits: torch.Tensor, requests: list[Request]
    ) -> list[tuple[int, dict[int, float] | None]]:
        """Token and (when asked) top logprobs for each request's row of ``logits [B, V]``."""
        logits = logits.float().cpu()
        out = []
        for row, request in zip(logits, requests, strict=True):
            params = request.params
            adjusted = penalize(row, request, params)
            if request.logits_processor is not None:
                adjusted = request.logits_processor(request.output, adjusted)
            if params.greedy:
                token = int(adjusted.argmax())
            else:
                probs = filtered_probs(adjusted, params)
                token = int(torch.multinomial(probs, 1, generator=self.generator(request)))
            out.append((token, top_logprobs(row, token, params.logprobs)))
        return out


def penalize(logits: torch.Tensor, request: Request, params: SamplingParams) -> torch.Tensor:
    """Repetition penalty over prompt and output; presence and frequency penalties over the output."""
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(request.tokens)), dtype=torch.long)
        scores = logits[seen]
        logits = logits.clone()
        logits[seen] = torch.where(
            scores > 0, scores / params.repetition_penalty, scores * params.repetition_penalty
        )
    if (params.presence_penalty or params.frequency_penalty) and request.output:
        counts = torch.bincount(torch.tensor(request.output), minlength=logits.shape[0])[
            : logits.shape[0]
        ].float()
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    return logits


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    probs = (logits / params.temperature).softmax(dim=-1)
    if params.top_k and params.top_k < probs.shape[0]:
        kth = probs.topk(params.top_k).values[-1]
        probs = probs.masked_fill(probs < kth, 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass of strictly better tokens
        probs = probs.scatter(0, order, sorted_probs.masked_fill(before >= params.top_p * probs.sum(), 0.0))
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def top_logprobs(logits: torch.Tensor, token: int, n: int | None) -> dict[int, float] | None:
    """The sampled token's logprob and the ``n`` best, under the model's own distribution."""
    if n is None:
        return None
    logp = logits.log_softmax(dim=-1)
    best = logp.topk(n) if n else None
    picked = {token: float(logp[token])}
    if best is not None:
        picked.update(zip(best.indices.tolist(), best.values.tolist(), strict=True))
    return picked
