"""Requests and their sampling parameters."""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch

from engine.prompt_logprobs import PromptLogprob

# (output tokens so far, logits [V]) -> adjusted logits; may keep state (e.g. a grammar matcher), so one
# instance per request. It sees every output token in order, also after a preemption recomputes them.
LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]

SEED_RANGE = (-(2**63), 2**64 - 1)  # what a torch.Generator takes
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32: top_p and penalties stay above it
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 1024  # characters: the held-back text of a stream is at most this long
MAX_LOGPROBS = 20  # top logprobs per token, sampled or prompt (vLLM's default max_logprobs)


class InvalidRequest(ValueError):
    """A request the engine could never run; ``field`` names the argument at fault (``prompt`` or
    ``max_tokens``), so an API can point its client at the right field."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = 16  # None: up to the end of the context (LLM.generate), as vLLM
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # also return this many top logprobs per sampled token
    prompt_logprobs: int | None = None  # return each prompt token's logprob and this many top ones
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0  # before this many, neither EOS, a stop token nor a stop string ends the output
    n: int = 1  # outputs per prompt: LLM.generate (and the server) run n sequences of one each
    skip_special_tokens: bool = True  # in the output text
    include_stop_str_in_output: bool = False  # the text ends after the stop string it stopped at, not before

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        # vLLM's forms: None, one stop string, lists (a string is not a list of its characters).
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        for name, value in vars(self).items():
            if name in _INTEGERS or (name in _OPTIONAL_INTEGERS and value is not None):
                need(is_integer(value), f"{name}={value!r} must be an integer")
            elif name in _NUMBERS:
                need(isinstance(value, numbers.Real) and not isinstance(value, bool),
                     f"{name}={value!r} must be a number")  # fmt: skip
        need(
            self.max_tokens is None or self.max_tokens >= 1,
            f"max_tokens={self.max_tokens} must be at least 1",
        )
        need(1 <= self.n <= 64, f"n={self.n} must be in [1, 64]")
        need(0 <= self.min_tokens <= (self.max_tokens or self.min_tokens),
             f"min_tokens={self.min_tokens} must be in [0, max_tokens={self.max_tokens}]")  # fmt: skip
        need(0.0 <= self.temperature <= 100.0, f"temperature={self.temperature} must be in [0, 100]")
        need(self.top_k >= 0, f"top_k={self.top_k} must be >= 0 (0 disables it)")
        need(FLOAT32_TINY <= self.top_p <= 1.0, f"top_p={self.top_p} must be in [{FLOAT32_TINY}, 1]")
        need(0.0 <= self.min_p <= 1.0, f"min_p={self.min_p} must be in [0, 1]")
        need(
            FLOAT32_TINY <= self.repetition_penalty <= 10.0,
            f"repetition_penalty={self.repetition_penalty} must be in [{FLOAT32_TINY}, 10]",
        )
        need(
            -2.0 <= self.presence_penalty <= 2.0,
            f"presence_penalty={self.presence_penalty} must be in [-2, 2]",
        )
        need(
            -2.0 <= self.frequency_penalty <= 2.0,
            f"frequency_penalty={self.frequency_penalty} must be in [-2, 2]",
        )
        for name in ("logprobs", "prompt_logprobs"):
            count = getattr(self, name)
            need(
                count is None or 0 <= count <= MAX_LOGPROBS, f"{name}={count} must be in [0, {MAX_LOGPROBS}]"
            )
        low, high = SEED_RANGE
        need(self.seed is None or low <= self.seed <= high, f"seed={self.seed} must be in [{low}, {high}]")
        need(
            all(isinstance(s, str) and s for s in self.stop), f"stop={self.stop!r} must be non-empty strings"
        )
        need(len(self.stop) <= MAX_STOP_STRINGS, f"{len(self.stop)} stop strings: at most {MAX_STOP_STRINGS}")
        longest = max(map(len, self.stop), default=0)
        need(longest <= MAX_STOP_LENGTH, f"a stop string of {longest} characters: at most {MAX_STOP_LENGTH}")
        need(all(is_integer(t) and t >= 0 for t in self.stop_token_ids),
             f"stop_token_ids={self.stop_token_ids!r} must be non-negative integers")  # fmt: skip

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows to inf and the probabilities turn NaN.
        return self.temperature < 1e-5


_INTEGERS = ("top_k", "min_tokens", "n")
_OPTIONAL_INTEGERS = ("max_tokens", "seed", "logprobs", "prompt_logprobs")
_NUMBERS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def is_integer(value: object) -> bool:
    """An int (numpy's too), not a bool and not a float, whole or not: a count or an id."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass
class Proposal:
    """Draft tokens for a request's next step and, unless drawn deterministically, the logits ``[K, V]``
    each was drawn from (the sampler turns them into the proposal distribution as it did to draw)."""

    tokens: list[int]
    logits: torch.Tensor | None = None


class Status(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"  # this request alone failed in a step (``Request.error`` says why)


_ids = itertools.count()


@dataclass(eq=False)
class Request:
    prompt: list[int]
    params: SamplingParams
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per output token, when asked
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)  # prompt tokens 1.., when asked
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    num_computed: int = 0  # tokens whose KV is in the cache
    arrival: int = 0  # scheduling order (FCFS)
    stop_text_at: int | None = None  # where the detokenised output is cut at the stop string it stopped at
    logits_processor: LogitsProcessor | None = None  # applied after the penalties, before sampling
    proposal: Proposal | None = None  # drafts to verify in the next step (speculative decoding)
    error: str | None = None  # why it finished with FinishReason.ERROR
    scheduled_at: float | None = None  # time.monotonic() when first scheduled (queue time for metrics)
    num_cached: int | None = None  # prompt tokens the prefix cache held when first scheduled

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def scoring_prompt(self) -> bool:
        """It asked for prompt logprobs and some are not computed yet."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt) - 1

    @property
    def prefilling(self) -> bool:
        """Tokens already known (prompt, or output to recompute after preemption) remain to be computed."""
        return self.num_computed < self.num_tokens - 1
