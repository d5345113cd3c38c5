"""Load beyond capacity and shutdown, each on a server of its own: a full queue answers 503 at once and
nothing hangs; SIGTERM drains for at most --shutdown-timeout and a second signal ends at once, and
either way every stream ends with an error event or its finish, then [DONE]."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from tests.server.conftest import API_KEY, Served, serving

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
SMALL = ["--max-num-seqs", "4", "--max-model-len", "1024", "--torch-threads", "1", "--log-level", "warning"]


@pytest.fixture(scope="module")
def queue_of_100(tmp_path_factory) -> Iterator[Served]:
    log = tmp_path_factory.mktemp("queue") / "server.log"
    with serving(log, *SMALL, "--max-waiting-requests", "100") as (served, _):
        yield served


def test_600_concurrent_requests_over_a_queue_of_100_get_200_or_503(queue_of_100: Served):
    async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
        body = {"prompt": f"Request {i}", "max_tokens": 2, "ignore_eos": True}
        return await client.post("/v1/completions", json=body)

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=600, max_keepalive_connections=0)
        async with httpx.AsyncClient(
            base_url=queue_of_100.url, headers=HEADERS, limits=limits, timeout=120
        ) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(600))), 300)

    responses = asyncio.run(burst())
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 503}, sorted(set(statuses))
    refused = [r for r in responses if r.status_code == 503]
    assert 104 <= statuses.count(200) and refused  # 4 running + 100 waiting at once, at the least
    assert all(r.headers["retry-after"] and r.json()["error"]["code"] == "server_busy" for r in refused)
    assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in responses if r.status_code == 200)
    queue_of_100.wait_idle()
    print(f"600 concurrent requests, queue of 100: {statuses.count(200)} served, {len(refused)} refused")


@dataclass
class Stream:
    events: list[dict | str] = field(default_factory=list)

    @property
    def started(self) -> bool:
        return any(isinstance(e, dict) and e.get("choices") for e in self.events)

    @property
    def closed_properly(self) -> bool:
        """[DONE] last, after either the finish of its choice or an error event."""
        if not self.events or self.events[-1] != "[DONE]":
            return False
        errors = [e for e in self.events[:-1] if isinstance(e, dict) and "error" in e]
        finished = any(
            isinstance(e, dict) and any(c.get("finish_reason") for c in e.get("choices", []))
            for e in self.events
        )
        return bool(errors) != finished  # exactly one way of ending

    @property
    def failed(self) -> bool:
        return any(isinstance(e, dict) and "error" in e for e in self.events)


async def stream(client: httpx.AsyncClient, record: Stream, max_tokens: int) -> None:
    body = {"prompt": "Tell me a long story", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                record.events.append(data if data == "[DONE]" else json.loads(data))


async def shut_down(served: Served, proc: subprocess.Popen, signals: list[signal.Signals], gap: float):
    """10 short streams, then 10 that cannot finish in time, then `signals` `gap` seconds apart. Returns the
    streams, the seconds from the first signal to the exit, what a new request and /health got, the exit
    code."""
    async with httpx.AsyncClient(base_url=served.url, headers=HEADERS, timeout=120) as client:
        records = [Stream() for _ in range(20)]
        tasks = [asyncio.ensure_future(stream(client, r, 4)) for r in records[:10]]
        await asyncio.sleep(1.0)  # admitted ahead of the long ones (FCFS)
        tasks += [asyncio.ensure_future(stream(client, r, 1000)) for r in records[10:]]
        deadline = time.monotonic() + 120
        while not any(r.started for r in records):
            assert time.monotonic() < deadline, "the streams did not start"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        start = time.monotonic()
        proc.send_signal(signals[0])
        await asyncio.sleep(0.3)
        late = await client.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
        health = await client.get("/health")
        for sig in signals[1:]:
            await asyncio.sleep(gap)
            proc.send_signal(sig)
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
    exit_code = await asyncio.to_thread(proc.wait, 120)
    return records, time.monotonic() - start, (late.status_code, health.status_code), exit_code


def test_sigterm_drains_within_the_timeout_and_closes_every_stream(tmp_path):
    with serving(tmp_path / "server.log", *SMALL, "--shutdown-timeout", "4") as (served, proc):
        records, elapsed, (late, health), code = asyncio.run(shut_down(served, proc, [signal.SIGTERM], 0))
    assert late == 503 and health == 503  # still listening, no longer admitting
    assert all(r.closed_properly for r in records), [r.events[-3:] for r in records if not r.closed_properly]
    assert not any(r.failed for r in records[:10])  # the short ones finished while draining
    assert all(r.failed for r in records[10:])  # the long ones were ended at the timeout
    assert code == 0 and elapsed < 4.5, elapsed  # 4 s, and the slack of measuring it from outside
    print(f"SIGTERM, 20 streams, --shutdown-timeout 4: exited after {elapsed:.1f} s")


def test_a_second_signal_ends_everything_at_once(tmp_path):
    with serving(tmp_path / "server.log", *SMALL, "--shutdown-timeout", "60") as (served, proc):
        signals = [signal.SIGTERM, signal.SIGINT]
        records, elapsed, _, code = asyncio.run(shut_down(served, proc, signals, 0.5))
    assert all(r.closed_properly for r in records), [r.events[-3:] for r in records if not r.closed_properly]
    assert code == 0 and elapsed < 3, elapsed  # not the 60 s of the drain
    print(f"SIGTERM then SIGINT, 20 streams: exited after {elapsed:.1f} s")
