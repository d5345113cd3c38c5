"""The engine loop: ``LLMEngine.step() = Scheduler.schedule() -> ModelRunner.run() -> Sampler -> update``
(``-> Proposer`` when speculating), and ``LLM``, the offline API on top of it."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache import KVCacheManager
from engine.model_runner import ModelRunner
from engine.request import FinishReason, Request, SamplingParams, Status
from engine.sampler import Sampler
from engine.scheduler import ScheduledChunk, Scheduler
from engine.spec_decode import SPECULATIVE_METHODS, build_proposer
from engine.spec_decode.proposer import Observation, Proposer
from engine.spec_decode.stats import SpecDecodeStats
from model.cache import cache_groups
from model.checkpoint import load_model
from model.deepseek_v4 import DeepseekV4
from model.deepseek_v41 import DeepseekV41
from model.tokenizer import load_tokenizer, prompt_ids
from triton_kernels.tuning import load_tuned_files


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int = 4096
    block_size: int = 16
    kv_cache_memory: int = 256 * 2**20  # bytes for the KV cache blocks
    seed: int = 0
    speculative_method: str | None = None  # "mtp" (V4 MTP layer) or "dspark" (DSpark stages)
    num_speculative_tokens: int | None = None  # drafts per step; default: 1 for mtp, the DSpark block
    dspark_min_confidence: float = 0.0  # verify the draft prefix whose confidence product stays above

    def __post_init__(self) -> None:
        if self.speculative_method not in (None, *SPECULATIVE_METHODS):
            raise ValueError(
                f"speculative_method={self.speculative_method!r} must be one of {SPECULATIVE_METHODS}"
            )
        if self.num_speculative_tokens is not None and not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} must be in [1, 16]")


@dataclass(frozen=True)
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[dict[int, float]] | None


class LLMEngine:
    def __init__(
        self,
        model: DeepseekV4 | DeepseekV41,
        tokenizer: Tokenizer,
        config: EngineConfig,
        proposer: Proposer | None = None,
    ):
        """``proposer`` replaces the one ``config.speculative_method`` names (tests, benchmarks)."""
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.tuned_files = load_tuned_files()  # a bad file fails here, before any request
        groups = cache_groups(model.cfg, model.embed.weight.element_size())
        self.cache = KVCacheManager.from_budget(groups, config.block_size, config.kv_cache_memory)
        self.runner = ModelRunner(model, self.cache)
        self.sampler = Sampler(config.seed)
        self.proposer, self.num_drafts = build_proposer(
            config, model, self.runner.pools, self.sampler, proposer
        )
        self.spec_stats = SpecDecodeStats()
        self.lookahead = self.proposer.lookahead if self.proposer else 0
        self.scheduler = Scheduler(
            self.cache, config.max_num_seqs, config.max_num_batched_tokens, self.lookahead
        )
        self.requests: dict[str, Request] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._arrivals = 0

    def add_request(
        self, prompt: list[int], params: SamplingParams, request_id: str | None = None
    ) -> Request:
        """Validate and queue a request; everything that could never run is rejected here."""
        vocab, limit = self.model.cfg.vocab_size, self.config.max_model_len
        if not prompt:
            raise ValueError("prompt is empty: at least one token is required")
        bad = next((t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(prompt) + params.max_tokens > limit:
            raise ValueError(
                f"{len(prompt)} prompt tokens + max_tokens={params.max_tokens} exceed max_model_len={limit}"
            )
        peak = self.cache.max_blocks(
            len(prompt) + params.max_tokens + self.lookahead,
            self.config.max_num_batched_tokens + self.lookahead,
        )
        if peak > self.cache.num_blocks:
            raise ValueError(
                f"request needs up to {peak} KV cache blocks; the cache has {self.cache.num_blocks}"
            )
        request = Request(list(prompt), params, arrival=self._arrivals)
        if request_id is not None:
            if request_id in self.requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            request.id = request_id
        self._arrivals += 1
        self.requests[request.id] = request
        self.detokenizers[request.id] = IncrementalDetokenizer(self.tokenizer)
        self.scheduler.add(request)
        return request

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
        if not chunks:
            return []
        out = self.runner.run(chunks)
        logits = iter(out.logits)
        updated, observations = [], []
        for chunk, features in zip(chunks, out.features, strict=True):
            request, committed, wanted = chunk.request, chunk.length, 0
            if chunk.samples:
                committed = self._sample(chunk, next(logits))
                updated.append(request)
                wanted = self._drafts_wanted(request)
            request.num_computed = chunk.start + committed
            if self.proposer and not request.finished:
                seq = self.runner.seqs[request.id]
                observations.append(Observation(request, seq, chunk.start, features[:committed], wanted))
        if observations:
            for observation, proposal in zip(observations, self.proposer.propose(observations), strict=True):
                observation.request.proposal = proposal
        for chunk in chunks:  # after drafting: the MTP catch-up reads the window back from the chunk start
            if not chunk.request.finished:
                self.cache.release_old(chunk.request.id, chunk.request.num_computed)
        return updated

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
        detok.add(token)
        stop_at = min((i for s in params.stop if (i := detok.text.find(s)) >= 0), default=None)
        if stop_at is not None:
            request.stop_text_at = stop_at
            self._finish(request, FinishReason.STOP)
        elif token in params.stop_token_ids or (
            token == self.model.cfg.eos_token_id and not params.ignore_eos
        ):
            self._finish(request, FinishReason.STOP)
        elif len(request.output) >= params.max_tokens or request.num_tokens >= self.config.max_model_len:
            self._finish(request, FinishReason.LENGTH)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self.scheduler.finish(request, reason)
        self.runner.release(request.id)
        self.sampler.forget(request)
        request.proposal = None
        if self.proposer:
            self.proposer.release(request.id)

    def text(self, request: Request) -> str:
        text = self.tokenizer.decode(request.output, skip_special_tokens=True)
        return text if request.stop_text_at is None else text[: request.stop_text_at]

    def completion(self, request: Request) -> Completion:
        self.requests.pop(request.id, None)
        self.detokenizers.pop(request.id, None)
        return Completion(
            request.id,
            request.prompt,
            list(request.output),
            self.text(request),
            request.finish_reason.value if request.finish_reason else "",
            request.logprobs if request.params.logprobs is not None else None,
        )


class LLM:
    """Offline generation: ``LLM(model_dir).generate(prompts, params)``; no ``model_dir`` = tiny V4.1."""

    def __init__(self, model_dir: str | Path | None = None, **config: int):
        if model_dir is None:
            from model.tiny import cached_tiny

            model_dir = cached_tiny("v41")
        self.engine = LLMEngine(load_model(model_dir), load_tokenizer(model_dir), EngineConfig(**config))

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        progress: bool = False,
    ) -> list[Completion]:
        """One completion per prompt; a single text or token-id list is one prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        engine, bos = self.engine, self.engine.model.cfg.bos_token_id
        requests = [
            engine.add_request(p if isinstance(p, list) else prompt_ids(engine.tokenizer, p, bos), sp)
            for p, sp in zip(prompts, params, strict=True)
        ]
        done = 0
        while engine.has_work:
            engine.step()
            finished = sum(r.status is Status.FINISHED for r in requests)
            if progress and finished != done:
                print(f"\rgenerated {finished}/{len(requests)}", end="", file=sys.stderr)
            done = finished
        if progress:
            print(file=sys.stderr)
        return [engine.completion(r) for r in requests]
