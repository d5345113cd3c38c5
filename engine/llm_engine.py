"""The engine loop: ``LLMEngine.step() = Scheduler.schedule() -> ModelRunner.run() -> Sampler -> update``
(``-> Proposer`` when speculating). ``engine.factory`` builds it; ``engine.llm.LLM`` and the server
drive it."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from engine.config import EngineConfig
from engine.decode_graphs import DecodeGraphs
from engine.detokenizer import IncrementalDetokenizer
from engine.interface import EngineStats
from engine.kv_cache import KVCacheManager
from engine.model_runner import ModelRunner
from engine.prompt_logprobs import PromptLogprob, score_prompt
from engine.request import FinishReason, InvalidRequest, LogitsProcessor, Request, SamplingParams, is_integer
from engine.sampler import Sampler
from engine.scheduler import ScheduledChunk, Scheduler
from engine.spec_decode import build_proposer
from engine.spec_decode.proposer import Observation, Proposer
from engine.spec_decode.stats import SpecDecodeStats
from model.cache import BoundaryState, SeqCache
from model.causal_lm import CausalLM
from triton_kernels.tuning import load_tuned_files

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[dict[int, float]] | None
    prompt_logprobs: list[PromptLogprob] | None = None  # prompt tokens 1.., when asked

    @classmethod
    def of(cls, request: Request, text: str) -> Completion:
        """A finished request's result; ``text``: its output decoded up to any stop string."""
        return cls(
            request.id,
            request.prompt,
            list(request.output),
            text,
            request.finish_reason.value if request.finish_reason else "",
            request.logprobs if request.params.logprobs is not None else None,
            request.prompt_logprobs if request.params.prompt_logprobs is not None else None,
        )


class LLMEngine:
    """The ``Engine`` of one process, or of rank 0 over tensor-parallel workers (its runner's)."""

    def __init__(
        self,
        model: CausalLM,
        tokenizer: Tokenizer,
        config: EngineConfig,
        proposer: Proposer | None = None,
        runner: ModelRunner | None = None,
    ):
        """``proposer`` replaces the one ``config.speculative_method`` names (tests, benchmarks);
        ``runner`` runs the steps over its KV cache (``engine.factory`` gives rank 0's under tensor
        parallelism); None: a runner of this process alone, over the cache ``config`` sizes."""
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.tuned_files = load_tuned_files()  # a bad file fails here, before any request
        self.runner = runner or ModelRunner(model, KVCacheManager.for_model(model, config))
        self.cache = self.runner.cache
        self.sampler = Sampler(config.seed, model.cfg.eos_token_id)
        self.proposer, self.num_drafts = build_proposer(
            config, model, self.runner.pools, self.sampler, proposer, self.runner.share
        )
        if (
            type(self.runner) is ModelRunner
        ):  # not over tensor-parallel ranks: each would need the same graphs
            self.runner.graphs = DecodeGraphs.for_engine(model, self.runner.pools, config, self.num_drafts)
        self.spec_stats = SpecDecodeStats()
        self.lookahead = self.proposer.lookahead if self.proposer else 0
        self.scheduler = Scheduler(
            self.cache, config.max_num_seqs, config.max_num_batched_tokens, self.lookahead
        )
        self.requests: dict[str, Request] = {}
        self.step_tokens = 0  # tokens the last step computed
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._arrivals = 0

    def add_request(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        logits_processor: LogitsProcessor | None = None,
    ) -> Request:
        """Validate and queue a request; everything that could never run is rejected here."""
        self.validate(prompt, params)
        request = Request(list(prompt), params, arrival=self._arrivals)
        request.logits_processor = logits_processor
        if request_id is not None:
            if request_id in self.requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            request.id = request_id
        self._arrivals += 1
        self.requests[request.id] = request
        self.detokenizers[request.id] = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        self.scheduler.add(request)
        return request

    def validate(self, prompt: list[int], params: SamplingParams) -> None:
        """Reject a request this engine could never run (``InvalidRequest`` naming the field)."""
        vocab, limit = self.model.cfg.vocab_size, self.config.max_model_len
        if params.n != 1:
            raise ValueError(f"n={params.n}: a request is one sequence (LLM.generate and the server run n)")
        if not prompt:
            raise InvalidRequest("prompt is empty: at least one token is required", "prompt")
        bad = next((t for t in prompt if not is_integer(t) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})", "prompt")
        if len(prompt) + params.max_tokens > limit:
            raise InvalidRequest(
                f"{len(prompt)} prompt tokens + max_tokens={params.max_tokens} exceed max_model_len={limit}",
                "max_tokens",
            )
        peak = self.cache.max_blocks(
            len(prompt) + params.max_tokens + self.lookahead,
            self.config.max_num_batched_tokens + self.lookahead,
        )
        if peak > self.cache.num_blocks:
            raise InvalidRequest(
                f"request needs up to {peak} KV cache blocks; the cache has {self.cache.num_blocks}",
                "max_tokens",
            )

    def abort(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is not None and not request.finished:
            self._finish(request, FinishReason.ABORT)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[Request]:
        """Run one step; return the requests that produced tokens or finished in it."""
        chunks = self.scheduler.schedule()
        self.step_tokens = sum(chunk.length for chunk in chunks)
        if not chunks:
            return []
        self._resume_hits()
        out = self.runner.run(chunks)
        logits = iter(out.logits)
        updated, observations = [], []
        for chunk, features, prompt_logits in zip(chunks, out.features, out.prompt_logits, strict=True):
            request, committed, wanted = chunk.request, chunk.length, 0
            if chunk.scored:
                _score(chunk, prompt_logits)
            if chunk.samples:
                updated.append(request)
                try:
                    committed = self._sample(chunk, next(logits))
                except Exception as err:  # its own parameters or logits processor: it alone fails
                    self._fail(request, err)
                    continue
                wanted = self._drafts_wanted(request)
            request.num_computed = chunk.start + committed
            if self.proposer and not request.finished:
                seq = self.runner.state(request.id)
                observations.append(Observation(request, seq, chunk.start, features[:committed], wanted))
        if observations:
            proposals = self.runner.propose(self.proposer, observations)
            for observation, proposal in zip(observations, proposals, strict=True):
                observation.request.proposal = proposal
        for chunk in chunks:  # after drafting: the MTP catch-up reads the window back from the chunk start
            if not chunk.request.finished:
                self._checkpoint(chunk)
                self.cache.release_old(chunk.request.id, chunk.request.num_computed)
        return updated

    def _resume_hits(self) -> None:
        """Requests admitted on a prefix-cache hit continue from the checkpoint's state, over copies of
        the blocks their boundary falls inside."""
        resumes = self.cache.take_resumes()
        assert all(isinstance(state, BoundaryState) for state in resumes.values())
        self.runner.resume(self.cache.take_copies(), resumes)
        if self.proposer:  # a resumed request's draft context starts over with it
            for request_id in resumes:
                self.proposer.release(request_id)

    def _checkpoint(self, chunk: ScheduledChunk) -> None:
        """A request whose step stopped on a page boundary: cache its pages and its state there (after
        drafting, so that the draft layer's window holds every position before it)."""
        request, prefix = chunk.request, self.cache.prefix
        reached = request.num_computed
        if prefix is None or reached <= chunk.start or reached % prefix.page_size:
            return
        seq: SeqCache = self.runner.state(request.id)
        self.cache.register(request.id, request.tokens[:reached], BoundaryState.of(seq))

    def _sample(self, chunk: ScheduledChunk, logits: torch.Tensor) -> int:
        """Emit the tokens of a sampling chunk (its accepted drafts, then the target's token) and roll the
        caches back to what it keeps; returns how many of the chunk's tokens stay in the cache."""
        request = chunk.request
        sampled = self.sampler(request, logits, request.proposal)
        committed = chunk.length - chunk.num_drafts + len(sampled) - 1
        if chunk.num_drafts:
            self.spec_stats.record(chunk.num_drafts, len(sampled) - 1)
            self.runner.rollback(chunk, committed)
        request.proposal = None
        for token, logprobs in sampled:
            self._append(request, token, logprobs)
            if request.finished:
                break
        return committed

    def _drafts_wanted(self, request: Request) -> int:
        """Drafts to verify next: none under a logits processor, never past ``max_tokens``."""
        if request.logits_processor is not None:
            return 0
        return max(0, min(self.num_drafts, request.params.max_tokens - len(request.output) - 1))

    def _append(self, request: Request, token: int, logprobs: dict[int, float] | None) -> None:
        params = request.params
        request.output.append(token)
        if logprobs is not None:
            request.logprobs.append(logprobs)
        detok = self.detokenizers[request.id]
        new = detok.add(token)
        may_stop = len(request.output) >= params.min_tokens
        stop_at = _first_stop(detok.text, len(new), params.stop) if may_stop else None
        if stop_at is not None and params.include_stop_str_in_output:
            stop_at += len(next(s for s in params.stop if detok.text.startswith(s, stop_at)))
        if stop_at is not None:
            request.stop_text_at = stop_at
            self._finish(request, FinishReason.STOP)
        elif may_stop and (
            token in params.stop_token_ids or (token == self.model.cfg.eos_token_id and not params.ignore_eos)
        ):
            self._finish(request, FinishReason.STOP)
        elif len(request.output) >= params.max_tokens or request.num_tokens >= self.config.max_model_len:
            self._finish(request, FinishReason.LENGTH)

    def _fail(self, request: Request, err: Exception) -> None:
        log.error("request %s failed in the engine step", request.id, exc_info=err)
        request.error = f"the request failed in the engine: {err}"
        if not request.finished:
            self._finish(request, FinishReason.ERROR)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self.scheduler.finish(request, reason)
        self.runner.release(request.id)
        self.sampler.forget(request)
        request.proposal = None
        if self.proposer:
            self.proposer.release(request.id)

    def streamed_text(self, request: Request) -> str:
        return self.detokenizers[request.id].text

    def stats(self) -> EngineStats:
        scheduler, cache = self.scheduler, self.cache
        spec = None if self.proposer is None else copy.deepcopy(self.spec_stats)  # read from another thread
        return EngineStats(len(scheduler.running), cache.num_blocks, cache.usage_ratio(), self.step_tokens,
                           scheduler.preemptions, scheduler.prefix_queries, scheduler.prefix_hits,
                           spec)  # fmt: skip

    def text(self, request: Request) -> str:
        text = self.tokenizer.decode(request.output, skip_special_tokens=request.params.skip_special_tokens)
        return text if request.stop_text_at is None else text[: request.stop_text_at]

    def completion(self, request: Request) -> Completion:
        self.requests.pop(request.id, None)
        self.detokenizers.pop(request.id, None)
        return Completion.of(request, self.text(request))


def _score(chunk: ScheduledChunk, logits: torch.Tensor) -> None:
    """Append the prompt logprobs of the chunk's scored positions (the logits at ``q`` score token
    ``q + 1``)."""
    request = chunk.request
    targets = request.prompt[chunk.scored.start + 1 : chunk.scored.stop + 1]
    request.prompt_logprobs += score_prompt(logits, targets, request.params.prompt_logprobs or 0)


def _first_stop(text: str, new: int, stops: tuple[str, ...]) -> int | None:
    """Where the first stop string starts in ``text``, given that none occurred before its last ``new``
    characters were added: only the new text and the stop's length before it are searched."""
    found = (text.find(s, max(0, len(text) - new - len(s) + 1)) for s in stops) if new else ()
    return min((i for i in found if i >= 0), default=None)
