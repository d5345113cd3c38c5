"""A poisoned request never touches its neighbours: with 8 greedy streams running, each of 10 hostile
requests gets its own 4xx (or goes away) while the 8 complete with exactly the output they have alone."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.server.conftest import API_KEY, MODEL, Served

HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
USER = {"role": "user", "content": "Hi"}


def chat(**fields: object) -> str:
    return json.dumps({"model": MODEL, "messages": [USER], "max_tokens": 4, **fields})


POISONS = {
    "seed 2**64": chat(seed=2**64),
    "seed 2**64-1 with n=2": chat(seed=2**64 - 1, n=2),
    "top_p 1e-46": chat(top_p=1e-46),
    "repetition_penalty 1e-40": chat(repetition_penalty=1e-40),
    "logit_bias key ²": chat(logit_bias={"²": 1}),
    "lone surrogate": chat(messages=[{"role": "user", "content": "\ud800"}]),
    "100,000 stop strings": chat(stop=["a"] * 100_000),
    "20 MB body": chat(user="x" * 20 * 2**20),
    "not JSON": '{"messages": [',
    "client leaving mid-stream": "leave",
}


async def good_stream(client: httpx.AsyncClient, i: int) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Tell me about the number {i}"}],
            "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    text = ""
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line.removeprefix("data: "))
                assert "error" not in event, event
                text += "".join(c["delta"].get("content") or "" for c in event["choices"])
    return text


async def poison(client: httpx.AsyncClient, raw: str) -> None:
    await asyncio.sleep(0.2)  # the good streams are running
    if raw == "leave":
        body = {"model": MODEL, "messages": [USER], "max_tokens": 200, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            async for _ in response.aiter_lines():
                return  # gone after the first event: the server aborts it
    response = await client.post("/v1/chat/completions", content=raw.encode())
    assert 400 <= response.status_code < 500 and "error" in response.json(), response.text[:300]


async def batch(url: str, raw: str | None) -> list[str]:
    async with httpx.AsyncClient(base_url=url, headers=HEADERS, timeout=120) as client:
        goods = asyncio.gather(*(good_stream(client, i) for i in range(8)))
        if raw is None:
            return await goods
        results, _ = await asyncio.gather(goods, poison(client, raw))
        return results


@pytest.fixture(scope="module")
def alone(server: Served) -> list[str]:
    return asyncio.run(batch(server.url, None))


@pytest.mark.parametrize("raw", POISONS.values(), ids=POISONS.keys())
def test_the_good_streams_are_untouched(server: Served, alone: list[str], raw: str):
    assert all(alone)
    assert asyncio.run(batch(server.url, raw)) == alone
    server.wait_idle()
