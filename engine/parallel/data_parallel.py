"""Data-parallel attention with expert parallel (design "Parallelism", stage B): every rank is an engine of
its own (requests, scheduler, KV cache, a whole model but for the routed experts, split over the ranks),
and the MoE blocks exchange their tokens by all-to-all (``model.parallel.modules.DispatchMoE``).

Rank 0 is the front. It spreads new requests over the ranks (the least loaded first) and keeps a shadow
of each request another rank runs. Every step it broadcasts the plan (the requests each rank admits,
the aborted ones) on the workers' CPU group; then every rank steps, and gathers what its requests
produced. The ranks step in lockstep: one with nothing to compute dispatches zero tokens through its MoE
blocks (``idle_step``), so every all-to-all finds all ranks; when speculating, every rank also runs as
many draft forwards as the rank that drafts the most (``LockstepProposer``). Processes and faults are
the workers' (``processes``), the rendezvous ``group``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from tokenizers import Tokenizer

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.interface import EngineStats
from engine.llm_engine import Completion, LLMEngine
from engine.parallel.plans import STEP, RankReport, next_plan, report
from engine.prompt_logprobs import PromptLogprob
from engine.request import (
    FinishReason,
    InvalidRequest,
    LogitsProcessor,
    Proposal,
    Request,
    SamplingParams,
    Status,
)
from engine.spec_decode.proposer import Observation, Proposer
from model.causal_lm import CausalLM
from model.parallel.modules import idle_step

if TYPE_CHECKING:  # its processes spawn this module's worker loop
    from engine.parallel.processes import Workers


@dataclass(frozen=True)
class Assigned:
    """A request the front gives a rank, under the front's id."""

    id: str
    prompt: list[int]
    params: SamplingParams


@dataclass
class DataParallelPlan:
    command: str
    admitted: dict[int, list[Assigned]] = field(default_factory=dict)  # by rank
    aborted: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Progress:
    """What a step added to a request on its rank."""

    id: str
    tokens: list[int]
    logprobs: list[dict[int, float]]
    finish_reason: FinishReason | None
    stop_text_at: int | None
    error: str | None
    # In a request's first progress (its first sampling step, when its prefill has scored them all).
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)


class LockstepProposer(Proposer):
    """A data-parallel rank's proposer: the ranks agree on the most draft forwards any of them runs this
    step, and the others dispatch no tokens through the draft layers for the rest (``Proposer.idle``), so
    each of the draft layers' all-to-alls finds every rank."""

    def __init__(self, inner: Proposer, device: torch.device):
        self.inner, self.device, self.lookahead = inner, device, inner.lookahead
        self.drafted = False  # this step

    def propose(self, observations: list[Observation]) -> list[Proposal | None]:
        own = self.inner.forwards(observations)
        most = self._most(own)
        proposals = self.inner.propose(observations)
        for _ in range(most - own):
            self.inner.idle()
        self.drafted = True
        return proposals

    def end_step(self) -> None:
        """After each step: a rank that did not draft joins the agreement and idles through every forward."""
        if not self.drafted:
            for _ in range(self._most(0)):
                self.inner.idle()
        self.drafted = False

    def _most(self, forwards: int) -> int:
        count = torch.tensor([forwards], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)  # the draft layers' group: every rank
        return int(count)

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)


def lockstep_engine(model: CausalLM, tokenizer: Tokenizer, config: EngineConfig) -> LLMEngine:
    """A data-parallel rank's engine, its proposer (if any) kept in lockstep with the other ranks'."""
    engine = LLMEngine(model, tokenizer, config)
    if engine.proposer is not None:
        engine.proposer = LockstepProposer(engine.proposer, model.embed.weight.device)
    return engine


def step_rank(engine: LLMEngine, admitted: list[Assigned], aborted: list[str]) -> list[Request]:
    """One rank's share of a step: admit and abort as planned, then step, or idle through the MoE blocks
    when nothing was computed (no request, or none the scheduler could place)."""
    for request in admitted:
        engine.add_request(request.prompt, request.params, request.id)
    for request_id in aborted:
        engine.abort(request_id)
    updated, computed = [], 0
    if engine.has_work:
        updated, computed = engine.step(), engine.step_tokens
    if not computed:
        idle_step(engine.model)
    if isinstance(engine.proposer, LockstepProposer):
        engine.proposer.end_step()
    return updated


def follow_front(engine: LLMEngine, control: dist.ProcessGroup, rank: int, world: int) -> None:
    """A worker rank's loop: rank 0's plans until it says stop; each step's progress goes back to it."""
    reported: dict[str, int] = {}  # output tokens already sent, by request
    while (plan := next_plan(control, world, engine.runner)) is not None:
        aborted = [i for i in plan.aborted if i in engine.requests]
        updated = step_rank(engine, plan.admitted.get(rank, []), aborted)
        progress = [_progress(r, reported) for r in updated]
        for request_id in aborted:  # the front finished them already
            reported.pop(request_id, None)
            engine.completion(engine.requests[request_id])
        for request in (r for r in updated if r.finished):
            reported.pop(request.id, None)
            engine.completion(request)
        dist.all_gather_object([None] * world, progress, group=control)


def _progress(request: Request, reported: dict[str, int]) -> Progress:
    sent = reported.get(request.id, 0)
    reported[request.id] = len(request.output)
    logprobs = request.logprobs[sent:] if request.logprobs else []
    prompt_logprobs = request.prompt_logprobs if sent == 0 else []
    return Progress(request.id, request.output[sent:], logprobs, request.finish_reason,
                    request.stop_text_at, request.error, prompt_logprobs)  # fmt: skip


class DataParallelEngine:
    """Rank 0's ``Engine``: the front over ``local`` (rank 0's own engine) and the worker ranks. A request
    another rank runs has a shadow here, which the ranks' progress updates; its statistics are rank 0's."""

    def __init__(self, local: LLMEngine, workers: Workers):
        self.local, self.workers = local, workers
        self.model, self.tokenizer, self.config = local.model, local.tokenizer, local.config
        self.tuned_files = local.tuned_files
        self.shadows: dict[str, tuple[int, Request]] = {}  # requests other ranks run, with their rank
        self.shadow_text: dict[str, IncrementalDetokenizer] = {}  # their streamed text, decoded here
        self.plan = DataParallelPlan(STEP)
        self.turn = 0  # the rank that gets the next request among equally loaded ones

    @property
    def world(self) -> int:
        return self.workers.world

    def _load(self, rank: int) -> int:
        if rank == 0:
            return sum(not r.finished for r in self.local.requests.values())
        return sum(r == rank and not s.finished for r, s in self.shadows.values())

    def add_request(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        logits_processor: LogitsProcessor | None = None,
    ) -> Request:
        """Queue the request on the least loaded rank (equals taken in turn), validated here first. A logits
        processor (structured output) cannot travel to another rank yet: refused there, not ignored."""
        rank = min(range(self.world), key=lambda r: (self._load(r), (r - self.turn) % self.world))
        if request_id is not None and (request_id in self.shadows or request_id in self.local.requests):
            raise ValueError(f"request id {request_id!r} is already in use")
        if rank and logits_processor is not None:
            raise InvalidRequest("logits processors (structured output) do not run under data parallel yet",
                                 "response_format")  # fmt: skip
        self.turn = (rank + 1) % self.world
        if rank == 0:
            return self.local.add_request(prompt, params, request_id, logits_processor)
        self.local.validate(prompt, params)  # every rank's engine has the same limits
        shadow = Request(list(prompt), params)
        if request_id is not None:
            shadow.id = request_id
        self.shadows[shadow.id] = (rank, shadow)
        self.shadow_text[shadow.id] = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        self.plan.admitted.setdefault(rank, []).append(Assigned(shadow.id, shadow.prompt, params))
        return shadow

    def abort(self, request_id: str) -> None:
        if request_id not in self.shadows:
            self.local.abort(request_id)
            return
        rank, shadow = self.shadows[request_id]
        if shadow.finished:
            return
        shadow.status, shadow.finish_reason = Status.FINISHED, FinishReason.ABORT
        waiting = self.plan.admitted.get(rank, [])
        if any(a.id == request_id for a in waiting):  # not sent yet: it never reaches its rank
            waiting[:] = [a for a in waiting if a.id != request_id]
        else:
            self.plan.aborted.append(request_id)

    @property
    def has_work(self) -> bool:
        return self.local.has_work or any(not s.finished for _, s in self.shadows.values())

    def step(self) -> list[Request]:
        """One lockstep step of every rank; the requests (any rank's) that produced tokens or finished."""
        plan, self.plan = self.plan, DataParallelPlan(STEP)
        with self.workers.guard():
            self.workers.broadcast(plan)
            updated = step_rank(self.local, plan.admitted.get(0, []), [])
            gathered = self.workers.gather([])
        for progress in (p for ranks in gathered[1:] for p in ranks):
            _, shadow = self.shadows.get(progress.id, (0, None))
            if shadow is None or shadow.finished:  # aborted here before the step
                continue
            shadow.output += progress.tokens
            for token in progress.tokens:
                self.shadow_text[shadow.id].add(token)
            shadow.logprobs += progress.logprobs
            shadow.prompt_logprobs += progress.prompt_logprobs
            shadow.stop_text_at, shadow.error = progress.stop_text_at, progress.error
            if progress.finish_reason is not None:
                shadow.status, shadow.finish_reason = Status.FINISHED, progress.finish_reason
            updated.append(shadow)
        return updated

    def streamed_text(self, request: Request) -> str:
        shadow = self.shadow_text.get(request.id)
        return self.local.streamed_text(request) if shadow is None else shadow.text

    def stats(self) -> EngineStats:
        return self.local.stats()

    def completion(self, request: Request) -> Completion:
        if self.shadows.pop(request.id, None) is None:
            return self.local.completion(request)
        self.shadow_text.pop(request.id, None)
        return Completion.of(request, self.local.text(request))

    def reports(self) -> list[RankReport]:
        return self.workers.reports(report(self.local.runner))
