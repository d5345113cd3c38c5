"""The engine behind the server: one thread owns the ``Engine`` and steps it; requests are async streams.

The engine is not thread-safe and a step blocks for as long as the model runs. A dedicated thread (unlike
an executor call per step) keeps every engine call, add and abort included, on one thread with no lock, and
leaves the event loop free while a step runs. The loop hands commands over a queue; the thread publishes
each sequence's progress to its request's asyncio queue.

The thread is supervised: a request that fails in a step fails alone (LLMEngine isolates it); any other
exception is logged and fails the requests in flight, and the thread carries on; should the thread itself
end, every waiter is woken with an error and nothing is accepted any more. Admission is bounded: at most
``max_num_seqs + max_waiting`` sequences are in the engine at once, the rest are refused (HTTP 503).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from engine.interface import Engine
from engine.prompt_logprobs import PromptLogprob
from engine.request import FinishReason, LogitsProcessor, Request, SamplingParams
from engine.server.metrics import Metrics

log = logging.getLogger(__name__)


class Unavailable(Exception):
    """The engine takes no more sequences now: full (``retry_after`` seconds), shutting down or dead."""

    def __init__(self, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class Update:
    """Progress of one sequence (choice `index`) since the previous update."""

    index: int
    token_ids: list[int]
    logprobs: list[dict[int, float]]
    text: str  # all text so far; final (stop strings cut) once finish_reason is set
    finish_reason: str | None = None  # stop, length, abort or error
    error: str | None = None
    status: int = 500  # with an error: 400 when the request's own input failed, 503 at shutdown
    cached_tokens: int = 0  # in the final update: prompt tokens the prefix cache held
    prompt_logprobs: list[PromptLogprob] | None = None  # in the first update, when the request asked


@dataclass
class _Sequence:
    request: Request
    index: int
    sink: Callable[[Update], None]
    arrival: float
    sent: int = 0
    first_token_at: float | None = None
    last_token_at: float = 0.0


@dataclass
class Group:
    """The sequences of one API request; updates of all of them arrive on one queue."""

    ids: list[str]
    updates: asyncio.Queue[Update] = field(default_factory=asyncio.Queue)
    created: int = field(default_factory=lambda: int(time.time()))  # the API's `created` (Unix seconds)


_Command = tuple[Callable[[], object], Future]


class AsyncEngine:
    def __init__(self, engine: Engine, metrics: Metrics, max_waiting: int = 256):
        if max_waiting < 0:
            raise ValueError(f"max_waiting={max_waiting} must be >= 0")
        self.engine, self.metrics = engine, metrics
        self.capacity = engine.config.max_num_seqs + max_waiting  # sequences admitted at once
        self.accepting = True  # False once shutting down
        self._commands: queue.Queue[_Command] = queue.Queue()
        self._live: dict[str, _Sequence] = {}
        self._admitted = 0  # sequences reserved by `add` and not yet gone; both threads change it
        self._lock = threading.Lock()
        self._stopping = False
        self._ended = False  # the thread has run its last command
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        # Read when scraped, so the gauges move as soon as requests are admitted or scheduled, also
        # while a long step runs.
        metrics.running.set_function(lambda: engine.stats().running)
        metrics.waiting.set_function(lambda: max(0, self._admitted - engine.stats().running))
        metrics.kv_usage.set_function(lambda: engine.stats().kv_usage)
        config = engine.config
        metrics.describe_cache(config.block_size, engine.stats().kv_blocks, config.prefix_caching)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._ended

    @property
    def in_flight(self) -> int:
        """Sequences admitted and not finished."""
        return self._admitted

    def stop(self) -> None:
        self._stopping = True
        self._call(lambda: None)
        self._thread.join(timeout=30)

    async def add(
        self, group_id: str, seqs: list[tuple[list[int], SamplingParams, LogitsProcessor | None]]
    ) -> Group:
        """Queue each (prompt, params, processor) as sequence `group_id-i`. Raises Unavailable when the
        engine cannot take them now, or ValueError, with nothing queued, if any of them could never run."""
        self._admit(len(seqs))
        loop = asyncio.get_running_loop()
        group = Group([f"{group_id}-{i}" for i in range(len(seqs))])

        def sink(update: Update) -> None:
            loop.call_soon_threadsafe(group.updates.put_nowait, update)

        def add_all() -> None:
            added: list[Request] = []
            try:
                for rid, (prompt, params, processor) in zip(group.ids, seqs, strict=True):
                    added.append(self.engine.add_request(prompt, params, rid, processor))
            except Exception:
                for request in added:
                    self._drop(request)
                raise
            now = time.monotonic()
            self.metrics.params_n.observe(len(added))
            for i, request in enumerate(added):
                self._live[request.id] = _Sequence(request, i, sink, now)
                self.metrics.prompt_tokens.inc(len(request.prompt))
                self.metrics.request_prompt_tokens.observe(len(request.prompt))
                self.metrics.params_max_tokens.observe(request.params.max_tokens)

        try:
            await asyncio.wrap_future(self._call(add_all))
        except asyncio.CancelledError:  # the handler went away: what add_all may have added is aborted
            self.abort(group)
            raise
        except BaseException:
            self._release(len(seqs))
            raise
        return group

    def abort(self, group: Group) -> None:
        """Stop the group's unfinished sequences and free their cache (safe to call at any time)."""

        def abort_all() -> None:
            for rid in group.ids:
                if (sequence := self._live.pop(rid, None)) is not None:
                    self._release(1)
                    self._drop(sequence.request)
                    self.metrics.finished("abort")

        self._call(abort_all)

    def fail_all(self, message: str, status: int) -> Future:
        """End every sequence in flight with an error update (shutdown); resolves once done."""
        return self._call(lambda: self._fail_all(message, status))

    # ---- admission -------------------------------------------------------------------------------------
    def _admit(self, n: int) -> None:
        if n > self.capacity:
            raise ValueError(
                f"{n} sequences in one request: this server can never admit more than {self.capacity}"
            )
        if not self.accepting:
            raise Unavailable("the server is shutting down")
        with self._lock:
            if self._ended:
                raise Unavailable("the engine is not running")
            if self._admitted + n > self.capacity:
                raise Unavailable(
                    f"the server is at capacity ({self._admitted} sequences in flight, at most "
                    f"{self.capacity}); retry later",
                    retry_after=1,
                )
            self._admitted += n

    def _release(self, n: int) -> None:
        with self._lock:
            self._admitted -= n

    # ---- the engine thread -----------------------------------------------------------------------------
    def _call(self, fn: Callable[[], object]) -> Future:
        future: Future = Future()
        with self._lock:  # the same lock as the thread's last act, so no command is left behind
            if self._ended:
                future.set_exception(Unavailable("the engine is not running"))
            else:
                self._commands.put((fn, future))
        return future

    def _drop(self, request: Request) -> None:
        if not request.finished:
            self.engine.abort(request.id)
        self.engine.completion(request)  # forgets the request and its detokenizer

    def _run(self) -> None:
        try:
            while not self._stopping:
                try:
                    self._cycle()
                except Exception:  # not one request's fault: fail what was in flight, then carry on
                    log.exception("the engine loop failed; failing the requests in flight")
                    self._fail_all("internal error in the engine", 500)
        except BaseException:  # the thread ends here: whatever ended it, the waiters must hear of it
            log.exception("the engine thread died")
        finally:
            self._wake_all()

    def _cycle(self) -> None:
        try:
            block = not self.engine.has_work
            while True:
                fn, future = self._commands.get(block=block, timeout=1.0 if block else None)
                block = False
                self._execute(fn, future)
        except queue.Empty:
            pass
        self._observe()
        if self._stopping or not self.engine.has_work:
            return
        for request in self.engine.step():
            self._publish(request)
        if step_tokens := self.engine.stats().step_tokens:
            self.metrics.iteration_tokens.observe(step_tokens)
        self._observe()

    @staticmethod
    def _execute(fn: Callable[[], object], future: Future) -> None:
        if not future.set_running_or_notify_cancel():  # its handler went away before it ran
            return
        try:
            result = fn()
        except ValueError as err:  # a request that could never run: its handler answers 400
            future.set_exception(err)
        except Exception as err:
            log.exception("an engine command failed")
            future.set_exception(err)
        else:
            future.set_result(result)

    def _publish(self, request: Request) -> None:
        sequence = self._live.get(request.id)
        if sequence is None:
            return
        now = time.monotonic()
        tokens = request.output[sequence.sent :]
        logprobs = request.logprobs[sequence.sent :]
        if tokens and sequence.first_token_at is None:
            sequence.first_token_at = now
            self.metrics.ttft.observe(now - sequence.arrival)
        elif tokens:
            for _ in tokens:  # a step's tokens share its latency
                self.metrics.itl.observe((now - sequence.last_token_at) / len(tokens))
        if tokens:
            sequence.last_token_at = now
        self.metrics.generation_tokens.inc(len(tokens))
        asked = request.params.prompt_logprobs is not None
        prompt_logprobs = request.prompt_logprobs if asked and sequence.sent == 0 else None
        sequence.sent = len(request.output)
        if not request.finished:
            text = self.engine.streamed_text(request)
            sequence.sink(Update(sequence.index, tokens, logprobs, text, prompt_logprobs=prompt_logprobs))
            return
        del self._live[request.id]
        self._release(1)
        completion = self.engine.completion(request)
        if request.finish_reason is FinishReason.ERROR:
            self.metrics.finished("error")
            sequence.sink(Update(sequence.index, [], [], "", "error", request.error, 400))
            return
        self._observe_finish(sequence, request, len(completion.token_ids), now)
        self.metrics.finished(completion.finish_reason)
        sequence.sink(Update(sequence.index, tokens, logprobs, completion.text, completion.finish_reason,
                             cached_tokens=request.num_cached or 0,
                             prompt_logprobs=prompt_logprobs))  # fmt: skip

    def _observe_finish(self, sequence: _Sequence, request: Request, generated: int, now: float) -> None:
        metrics, first = self.metrics, sequence.first_token_at
        metrics.request_generation_tokens.observe(generated)
        metrics.e2e.observe(now - sequence.arrival)
        if generated > 1 and first is not None:
            metrics.tpot.observe((now - first) / (generated - 1))
        if request.scheduled_at is not None:
            metrics.queue_time.observe(max(0.0, request.scheduled_at - sequence.arrival))
            metrics.inference_time.observe(now - request.scheduled_at)
            if first is not None:
                metrics.prefill_time.observe(max(0.0, first - request.scheduled_at))
                metrics.decode_time.observe(now - first)

    def _fail_all(self, message: str, status: int) -> None:
        for rid, sequence in list(self._live.items()):
            del self._live[rid]
            self._release(1)
            self._drop(sequence.request)
            self.metrics.finished("error")
            sequence.sink(Update(sequence.index, [], [], "", "error", message, status))

    def _wake_all(self) -> None:
        """The thread is ending: no command will run and no update will come, so tell every waiter."""
        self.accepting = False
        with self._lock:
            self._ended = True
        while not self._commands.empty():
            _, future = self._commands.get_nowait()
            if future.set_running_or_notify_cancel():
                future.set_exception(Unavailable("the engine is not running"))
        for rid, sequence in list(self._live.items()):
            del self._live[rid]
            self._release(1)
            sequence.sink(Update(sequence.index, [], [], "", "error", "the engine stopped", 503))

    def _observe(self) -> None:
        stats = self.engine.stats()
        self.metrics.observe_engine(stats.preemptions, stats.prefix_queries, stats.prefix_hits)
        if stats.spec_decode is not None:
            self.metrics.observe_spec_decode(stats.spec_decode)
