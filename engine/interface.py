"""What drives an engine: the ``Engine`` protocol ``LLM`` and the server use, implemented by
``LLMEngine`` (one process, or rank 0 over tensor-parallel workers) and ``DataParallelEngine`` (rank 0's
front over data-parallel ranks), and the ``EngineStats`` it reports."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from tokenizers import Tokenizer

from engine.config import EngineConfig
from engine.request import LogitsProcessor, Request, SamplingParams
from engine.spec_decode.stats import SpecDecodeStats

if TYPE_CHECKING:  # the engines import this module
    from engine.llm_engine import Completion
    from model.causal_lm import CausalLM


@dataclass(frozen=True)
class EngineStats:
    """The engine's gauges and running totals at one moment (cheap: read at every metrics scrape)."""

    running: int  # requests the scheduler runs
    kv_blocks: int  # blocks of the KV cache
    kv_usage: float  # the share of them requests hold
    step_tokens: int  # tokens the last step computed
    preemptions: int
    prefix_queries: int  # prompt tokens looked up in the prefix cache, and found there
    prefix_hits: int
    spec_decode: SpecDecodeStats | None  # None: not speculating


@runtime_checkable
class Engine(Protocol):
    """An engine's interface: built with ``model``, ``tokenizer`` and ``config``, it queues requests,
    steps them all together and hands each finished one back once."""

    model: CausalLM
    tokenizer: Tokenizer
    config: EngineConfig
    tuned_files: list[Path]  # the kernel configs tuned for this device that it runs with

    def add_request(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        logits_processor: LogitsProcessor | None = None,
    ) -> Request:
        """Validate and queue a request (``ValueError`` naming the field if it could never run)."""

    def abort(self, request_id: str) -> None:
        """Finish a request early (a finished or unknown one: nothing)."""

    @property
    def has_work(self) -> bool:
        """Whether a step would compute anything."""

    def step(self) -> list[Request]:
        """One step of every running request; those that produced tokens or finished in it."""

    def streamed_text(self, request: Request) -> str:
        """The text of a running request's output so far (stop strings not cut yet)."""

    def completion(self, request: Request) -> Completion:
        """A finished (or aborted) request's result; the engine forgets it."""

    def stats(self) -> EngineStats: ...
