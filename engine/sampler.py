"""Next-token sampling for one request, verifying the drafts of speculative decoding on the way.

Penalties, then the request's logits processor (constrained decoding), then temperature, top-k, top-p
and min-p, then a draw from each request's own generator, so a seeded request samples the same tokens
whatever batch it lands in. With drafts (model-spec §8.3) the target's logits at the K+1 verified
positions decide: greedy keeps the drafts that equal the target's argmax, then the target's token;
sampling keeps draft x with probability min(1, p(x)/q(x)), q the distribution x was drawn from, and
on the first rejection draws from normalize(max(0, p - q)), so the tokens are distributed exactly as
without drafts. A draft without a distribution (a deterministic proposer) has q one-hot.
"""

from __future__ import annotations

import torch

from engine.request import Proposal, Request, SamplingParams

Sampled = tuple[int, dict[int, float] | None]  # token, and its top logprobs when asked


class Sampler:
    def __init__(self, seed: int = 0, eos_token_id: int | None = None):
        """``eos_token_id``: banned, with the stop tokens, before a request's ``min_tokens``."""
        self.eos_token_id = eos_token_id
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
        self, request: Request, logits: torch.Tensor, proposal: Proposal | None = None
    ) -> list[Sampled]:
        """The tokens one step emits from the target's ``logits [K+1, V]`` at the positions that verify
        the first K draft tokens of ``proposal`` (K = 0: plain sampling): the accepted drafts, then the
        target's own token (correction or bonus)."""
        drafts = proposal.tokens[: logits.shape[0] - 1] if proposal else []
        if len(drafts) != logits.shape[0] - 1:
            raise ValueError(f"{logits.shape[0]} logit rows verify {len(drafts)} drafts: need one more row")
        if drafts and request.logits_processor is not None:
            raise ValueError("a request with a logits processor cannot verify drafts")
        params, output, out = request.params, list(request.output), []
        for k, row in enumerate(logits.float().cpu()):
            target = self._adjusted(request, row, output)
            if params.greedy:
                token = int(target.argmax())
                if not float(target[token]) > float("-inf"):  # -inf or NaN: nothing was allowed
                    raise ValueError("no token is allowed after the penalties and the logits processor")
            elif k < len(drafts):
                token = self._verify(request, filtered_probs(target, params), proposal, k, output)
            else:
                token = self._draw(request, filtered_probs(target, params))
            out.append((token, top_logprobs(row, token, params.logprobs)))
            output.append(token)
            if k == len(drafts) or token != drafts[k]:
                break
        return out

    def draft(self, request: Request, logits: torch.Tensor, drafted: list[int]) -> int:
        """A proposer's token from its ``logits [V]`` after the drafts so far (greedy: the argmax). Requests
        with a logits processor never draft: the processor's state follows the accepted output only."""
        output = request.output + drafted
        if request.params.greedy:
            return int(penalize(logits.float().cpu(), request.prompt, output, request.params).argmax())
        return self._draw(request, _proposal_probs(request, logits, output))

    def _verify(
        self, request: Request, p: torch.Tensor, proposal: Proposal, k: int, output: list[int]
    ) -> int:
        x = proposal.tokens[k]
        if proposal.logits is None:
            q = torch.zeros_like(p)
            q[x] = 1.0
        else:
            q = _proposal_probs(request, proposal.logits[k], output)
        if float(torch.rand(1, generator=self.generator(request))) * float(q[x]) < float(p[x]):
            return x
        residual = (p - q).clamp(min=0.0)
        return self._draw(request, residual / residual.sum() if residual.sum() > 0 else p)

    def _draw(self, request: Request, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator(request)))

    def _adjusted(self, request: Request, logits: torch.Tensor, output: list[int]) -> torch.Tensor:
        params = request.params
        adjusted = penalize(logits, request.prompt, output, params)
        if len(output) < params.min_tokens:
            ends = [*params.stop_token_ids]
            if self.eos_token_id is not None and not params.ignore_eos:
                ends.append(self.eos_token_id)
            adjusted = adjusted.index_fill(0, torch.tensor(ends, dtype=torch.long), float("-inf"))
        if request.logits_processor is not None:
            adjusted = request.logits_processor(output, adjusted)
        return adjusted


def _proposal_probs(request: Request, logits: torch.Tensor, output: list[int]) -> torch.Tensor:
    """What a proposer draws a sampled request's draft from, after ``output``."""
    return filtered_probs(
        penalize(logits.float().cpu(), request.prompt, output, request.params), request.params
    )


def penalize(
    logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams
) -> torch.Tensor:
    """Repetition penalty over prompt and output; presence and frequency penalties over the output."""
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long)
        scores = logits[seen]
        logits = logits.clone()
        logits[seen] = torch.where(
            scores > 0, scores / params.repetition_penalty, scores * params.repetition_penalty
        )
    if (params.presence_penalty or params.frequency_penalty) and output:
        counts = torch.bincount(torch.tensor(output), minlength=logits.shape[0])[: logits.shape[0]].float()
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    return logits


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution to draw from; the most likely token always survives top-p and min-p, so any
    parameters in range give one. Raises ValueError when no token is left (a processor masked them all)."""
    # A tiny repetition penalty or temperature can push a logit to +inf: clamped, softmax stays defined.
    scaled = (logits / params.temperature).clamp(max=torch.finfo(logits.dtype).max)
    probs = scaled.softmax(dim=-1)
    if not bool(torch.isfinite(probs).all()):
        raise ValueError("no token has a finite probability after the penalties and the logits processor")
    if params.top_k and params.top_k < probs.shape[0]:
        kth = probs.topk(params.top_k).values[-1]
        probs = probs.masked_fill(probs < kth, 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass of strictly better tokens
        cut = before >= params.top_p * probs.sum()
        cut[0] = False
        probs = probs.scatter(0, order, sorted_probs.masked_fill(cut, 0.0))
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
