"""The engine thread behind the server: bounded admission, gauges that move at once, and supervision (a
failed step fails only what was in flight; a dead thread wakes every waiter)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.llm_engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from engine.server.async_engine import AsyncEngine, Group, Unavailable, Update
from engine.server.metrics import Metrics
from model.checkpoint import load_model
from model.testing.tiny import write_tiny
from model.tokenizer import load_tokenizer

PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    path = write_tiny(tmp_path_factory.mktemp("tiny-v4"), arch="v4")
    return load_model(path), load_tokenizer(path)


def make_core(parts, max_num_seqs: int = 4, max_waiting: int = 8) -> AsyncEngine:
    engine = LLMEngine(*parts, EngineConfig(max_num_seqs=max_num_seqs))
    return AsyncEngine(engine, Metrics("tiny"), max_waiting)


def seqs(n: int) -> list:
    return [([1, 5, 9, 13], PARAMS, None)] * n


async def finals(group: Group, timeout: float = 60) -> list[Update]:
    out = []
    while len(out) < len(group.ids):
        update = await asyncio.wait_for(group.updates.get(), timeout)
        if update.finish_reason is not None:
            out.append(update)
    return out


def gauge(core: AsyncEngine, name: str) -> float:
    return core.metrics.registry.get_sample_value(name, {"model_name": "tiny", "engine": "0"})


class Gate:
    """Holds the engine thread inside `step` until opened, then runs `then` (the real step by default)."""

    def __init__(self, core: AsyncEngine):
        self.entered, self.open = threading.Event(), threading.Event()
        self.step, self.then = core.engine.step, core.engine.step
        core.engine.step = self

    def __call__(self):
        self.entered.set()
        self.open.wait(30)
        return self.then()


def test_admission_is_bounded_and_frees_up(parts):
    async def scenario() -> None:
        core = make_core(parts, max_num_seqs=2, max_waiting=1)
        core.start()
        try:
            first = await core.add("a", seqs(3))  # 2 running + 1 waiting: full
            with pytest.raises(Unavailable) as refused:
                await core.add("b", seqs(1))
            assert refused.value.retry_after and "at most 3" in str(refused.value)
            with pytest.raises(ValueError, match="never"):
                await core.add("c", seqs(4))  # more than could ever be admitted at once
            assert [u.finish_reason for u in await finals(first)] == ["length"] * 3
            again = await core.add("d", seqs(3))
            assert [u.finish_reason for u in await finals(again)] == ["length"] * 3
            assert core.in_flight == 0
        finally:
            core.stop()

    asyncio.run(scenario())


def test_gauges_follow_admission_while_a_step_runs(parts):
    async def scenario() -> None:
        core = make_core(parts)
        gate = Gate(core)
        core.start()
        try:
            first = await core.add("a", seqs(1))
            await asyncio.to_thread(gate.entered.wait, 30)  # the engine thread is now inside a step
            assert gauge(core, "vllm:num_requests_waiting") == 1
            # The engine thread takes the new sequences in only after its step; the gauges count them now.
            second = asyncio.create_task(core.add("b", seqs(2)))
            await asyncio.sleep(0)
            assert not second.done()
            assert gauge(core, "vllm:num_requests_running") == 0  # the held step has scheduled nothing yet
            assert gauge(core, "vllm:num_requests_waiting") == 3  # admitted, not yet scheduled
            gate.open.set()
            await finals(first)
            await finals(await second)
            assert gauge(core, "vllm:num_requests_running") == 0
            assert gauge(core, "vllm:num_requests_waiting") == 0
        finally:
            gate.open.set()
            core.stop()

    asyncio.run(scenario())


def test_a_failed_step_fails_what_was_in_flight_and_the_engine_carries_on(parts):
    async def scenario() -> None:
        core = make_core(parts)
        gate = Gate(core)

        def broken():
            core.engine.step = gate.step  # once
            raise RuntimeError("kernel fault")

        gate.then = broken
        core.start()
        try:
            group = await core.add("a", seqs(2))
            gate.open.set()
            failed = await finals(group)
            assert [(u.finish_reason, u.status) for u in failed] == [("error", 500)] * 2
            assert core.alive and core.in_flight == 0
            assert core.engine.cache.num_free == core.engine.cache.num_blocks
            after = await core.add("b", seqs(1))
            assert [u.finish_reason for u in await finals(after)] == ["length"]
        finally:
            core.stop()

    asyncio.run(scenario())


def test_a_dead_engine_thread_wakes_every_waiter(parts):
    async def scenario() -> None:
        core = make_core(parts)
        gate = Gate(core)

        def die():
            raise SystemExit  # what no `except Exception` catches

        gate.then = die
        core.start()
        running = await core.add("a", seqs(2))
        await asyncio.to_thread(gate.entered.wait, 30)
        queued = asyncio.ensure_future(core.add("b", seqs(1)))  # its command waits behind the step
        await asyncio.sleep(0.1)
        gate.open.set()
        assert [(u.finish_reason, u.status) for u in await finals(running)] == [("error", 503)] * 2
        with pytest.raises(Unavailable):
            await asyncio.wait_for(queued, 30)
        assert not core.alive
        with pytest.raises(Unavailable):
            await core.add("c", seqs(1))
        assert core.in_flight == 0

    asyncio.run(scenario())
