"""The engine behind the server: one thread owns the LLMEngine and steps it; requests are async streams.

The engine is not thread-safe and a step blocks for as long as the model runs. A dedicated thread (unlike
an executor call per step) keeps every engine call, add and abort included, on one thread with no lock, and
leaves the event loop free while a step runs. The loop hands commands over a queue; the thread publishes
each sequence's progress to its request's asyncio queue.
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

from engine.llm_engine import LLMEngine
from engine.metrics import Metrics
from engine.request import LogitsProcessor, Request, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class Update:
    """Progress of one sequence (choice `index`) since the previous update."""

    index: int
    token_ids: list[int]
    logprobs: list[dict[int, float]]
    text: str  # all text so far; final (stop strings cut) once finish_reason is set
    finish_reason: str | None = None  # stop, length, abort or error
    error: str | None = None


@dataclass
class _Sequence:
    index: int
    sink: Callable[[Update], None]
    arrival: float
    sent: int = 0
    first_token_at: float | None = None


@dataclass
class Group:
    """The sequences of one API request; updates of all of them arrive on one queue."""

    ids: list[str]
    updates: asyncio.Queue[Update] = field(default_factory=asyncio.Queue)
    created: int = field(default_factory=lambda: int(time.time()))  # the API's `created` (Unix seconds)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: Metrics):
        self.engine, self.metrics = engine, metrics
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._live: dict[str, _Sequence] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stopping = True
        self._commands.put(lambda: None)
        self._thread.join(timeout=30)

    async def add(
        self, group_id: str, seqs: list[tuple[list[int], SamplingParams, LogitsProcessor | None]]
    ) -> Group:
        """Queue each (prompt, params, processor) as sequence `group_id-i`; raises ValueError, with nothing
        queued, if any of them could never run."""
        loop = asyncio.get_running_loop()
        group = Group([f"{group_id}-{i}" for i in range(len(seqs))])

        def sink(update: Update) -> None:
            loop.call_soon_threadsafe(group.updates.put_nowait, update)

        def add_all() -> None:
            added: list[Request] = []
            try:
                for rid, (prompt, params, processor) in zip(group.ids, seqs, strict=True):
                    request = self.engine.add_request(prompt, params, rid)
                    request.logits_processor = processor
                    added.append(request)
            except ValueError:
                for request in added:
                    self._drop(request.id)
                raise
            now = time.monotonic()
            for i, request in enumerate(added):
                self._live[request.id] = _Sequence(i, sink, now)
                self.metrics.prompt_tokens.inc(len(request.prompt))

        await asyncio.wrap_future(self._call(add_all))
        return group

    def abort(self, group: Group) -> None:
        """Stop the group's unfinished sequences and free their cache (safe to call at any time)."""

        def abort_all() -> None:
            for rid in group.ids:
                if self._live.pop(rid, None) is not None:
                    self._drop(rid)
                    self.metrics.finished("abort")

        self._call(abort_all)

    def _call(self, fn: Callable[[], object]) -> Future[object]:
        future: Future[object] = Future()

        def command() -> None:
            try:
                future.set_result(fn())
            except Exception as err:  # handed to the awaiting request
                future.set_exception(err)

        self._commands.put(command)
        return future

    def _drop(self, rid: str) -> None:
        request = self.engine.requests.get(rid)
        if request is not None:
            if not request.finished:
                self.engine.abort(rid)
            self.engine.completion(request)  # forgets the request and its detokenizer

    def _run(self) -> None:
        while not self._stopping:
            try:
                block = not self.engine.has_work
                while True:
                    self._commands.get(block=block, timeout=1.0 if block else None)()
                    block = False
            except queue.Empty:
                pass
            if self._stopping or not self.engine.has_work:
                self._observe()
                continue
            try:
                updated = self.engine.step()
            except Exception:  # a failed step must not take the server down: fail what was running
                log.exception("engine step failed")
                self._fail_all("internal error in the engine step")
                continue
            for request in updated:
                self._publish(request)
            self._observe()

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
        self.metrics.generation_tokens.inc(len(tokens))
        sequence.sent = len(request.output)
        if not request.finished:
            text = self.engine.detokenizers[request.id].text
            sequence.sink(Update(sequence.index, tokens, logprobs, text))
            return
        del self._live[request.id]
        completion = self.engine.completion(request)
        n = len(completion.token_ids)
        if n > 1 and sequence.first_token_at is not None:
            self.metrics.tpot.observe((now - sequence.first_token_at) / (n - 1))
        self.metrics.e2e.observe(now - sequence.arrival)
        self.metrics.finished(completion.finish_reason)
        sequence.sink(Update(sequence.index, tokens, logprobs, completion.text, completion.finish_reason))

    def _fail_all(self, message: str) -> None:
        for rid, sequence in list(self._live.items()):
            del self._live[rid]
            self._drop(rid)
            self.metrics.finished("error")
            sequence.sink(Update(sequence.index, [], [], "", "error", message))

    def _observe(self) -> None:
        scheduler, cache = self.engine.scheduler, self.engine.cache
        self.metrics.observe_engine(
            len(scheduler.running),
            len(scheduler.waiting),
            cache.usage(),
            cache.num_blocks,
            scheduler.preemptions,
        )
        if self.engine.proposer is not None:
            self.metrics.observe_spec_decode(self.engine.spec_stats)
