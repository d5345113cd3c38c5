"""Stopping the server without losing a stream: uvicorn with a drain in front of its own shutdown.

The first SIGTERM (or SIGINT) stops admission, so new requests get 503 while the listening socket stays
open, and lets the sequences in flight finish for at most ``drain_timeout`` seconds; whatever remains then
ends with an error event. A second signal ends everything at once. Either way every stream is closed
properly (an error event, then ``[DONE]``) before uvicorn closes the connections and the process exits.
"""

from __future__ import annotations

import asyncio
import logging
from types import FrameType

import uvicorn

from engine.server.async_engine import AsyncEngine, Unavailable

log = logging.getLogger(__name__)

FLUSH_TIMEOUT = 5.0  # seconds the handlers get to write their last events once their sequences ended
CLOSE_RESERVE = 1.0  # of the drain timeout, kept for ending streams and closing, so the exit is within it


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, core: AsyncEngine, drain_timeout: float):
        super().__init__(config)
        self.core, self.drain_timeout = core, drain_timeout
        self.signals = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining: list[asyncio.Task] = []

    async def serve(self, sockets: list | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.signals += 1
        if self.loop is None:  # not serving yet: nothing to drain
            self.should_exit = True
            return
        if self.signals > 2:
            self.force_exit = True
            return
        timeout = max(0.0, self.drain_timeout - CLOSE_RESERVE) if self.signals == 1 else 0.0
        self.loop.call_soon_threadsafe(
            lambda: self.draining.append(asyncio.ensure_future(self.drain(timeout)))
        )

    async def drain(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        self.core.accepting = False
        log.warning("shutting down: %d sequences in flight, %.0f s to finish", self.core.in_flight, timeout)
        deadline = loop.time() + timeout
        while self.core.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.core.in_flight:
            log.warning("shutting down: ending %d sequences", self.core.in_flight)
            try:
                await asyncio.wrap_future(self.core.fail_all("the server is shutting down", 503))
            except Unavailable:
                pass  # the engine thread is gone: it already woke every waiter
        deadline = loop.time() + FLUSH_TIMEOUT
        while self.server_state.tasks and loop.time() < deadline:
            await asyncio.sleep(0.02)
        self.should_exit = True
