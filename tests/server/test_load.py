"""64 concurrent requests against the tiny model: all complete, /metrics counts them, the cache empties."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai

from tests.server.conftest import API_KEY, MODEL, Served

CONCURRENCY = 64
MAX_TOKENS = 4


async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, int]:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Request number {i}"}],
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, finish, completion_tokens = "", None, 0
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            completion_tokens = chunk.usage.completion_tokens
    return text, finish, completion_tokens


async def load(url: str) -> list[tuple[str, str | None, int]]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    try:
        return await asyncio.gather(*(one(client, i) for i in range(CONCURRENCY)))
    finally:
        await client.close()


def test_64_concurrent_streams_complete_and_are_counted(server: Served):
    def count(name: str, **labels: str) -> float:
        return server.metric(name, **labels)

    before = {
        "ok": count("deepseek:http_requests_total", endpoint="/v1/chat/completions", status="200"),
        "length": count("vllm:request_success_total", finished_reason="length"),
        "generated": count("vllm:generation_tokens_total"),
        "ttft": count("vllm:time_to_first_token_seconds_count"),
        "e2e": count("vllm:e2e_request_latency_seconds_count"),
        "drafted": count("vllm:spec_decode_num_draft_tokens_total"),
    }
    start = time.monotonic()
    results = asyncio.run(load(server.url))
    elapsed = time.monotonic() - start
    assert [(finish, n) for _, finish, n in results] == [("length", MAX_TOKENS)] * CONCURRENCY
    assert all(text for text, _, _ in results)
    assert (
        count("deepseek:http_requests_total", endpoint="/v1/chat/completions", status="200")
        == before["ok"] + 64
    )
    assert count("vllm:request_success_total", finished_reason="length") == before["length"] + 64
    assert count("vllm:generation_tokens_total") == before["generated"] + 64 * MAX_TOKENS
    assert count("vllm:time_to_first_token_seconds_count") == before["ttft"] + 64
    assert count("vllm:e2e_request_latency_seconds_count") == before["e2e"] + 64
    server.wait_idle()
    # Every request decodes 3 tokens after its first, each step verifying up to 2 DSpark drafts.
    assert count("vllm:spec_decode_num_draft_tokens_total") >= before["drafted"] + 64 * 2
    accepted = count("vllm:spec_decode_num_accepted_tokens_total")
    assert 0 <= accepted <= count("vllm:spec_decode_num_draft_tokens_total")
    assert count("vllm:spec_decode_num_drafts_total") >= 64  # each request verified at least once
    assert 0 <= count("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") <= accepted
    print(f"64 concurrent streams of {MAX_TOKENS} tokens: {elapsed:.1f} s")


def mixed_request(i: int) -> tuple[str, dict]:
    """Chat and completions, streamed and not, with n, logprobs, stop strings, seeds and JSON mode."""
    sampling = {"max_tokens": 4, "temperature": 0.8, "seed": i, "ignore_eos": True, "stream": i % 2 == 0}
    kind = i % 4
    if kind == 0:
        return "/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"Hello {i}"}],
            "stream_options": {"include_usage": True},
            **sampling,
        }
    if kind == 1:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": f"Hi {i}"}], "n": 2,
                                        "logprobs": True, "top_logprobs": 2, **sampling}  # fmt: skip
    if kind == 2:
        return "/v1/completions", {"prompt": f"Count {i}", "stop": ["\n", "ab"], "logprobs": 1, **sampling}
    return "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "A JSON object, please"}],
        "response_format": {"type": "json_object"},
        **{**sampling, "max_tokens": 8},
    }


async def mixed_one(client: httpx.AsyncClient, i: int) -> list[str]:
    """The finish reasons of the request's choices; any error fails the test."""
    path, body = mixed_request(i)
    if not body["stream"]:
        r = await client.post(path, json={"model": MODEL, **body})
        assert r.status_code == 200, r.text
        return [c["finish_reason"] for c in r.json()["choices"]]
    finishes = []
    async with client.stream("POST", path, json={"model": MODEL, **body}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line.removeprefix("data: "))
                assert "error" not in event, event
                finishes += [c["finish_reason"] for c in event["choices"] if c.get("finish_reason")]
    return finishes


def test_64_concurrent_mixed_requests_complete_and_the_cache_empties(server: Served):
    async def load() -> list[list[str]]:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=300) as client:
            return await asyncio.gather(*(mixed_one(client, i) for i in range(64)))

    errors = server.metric("vllm:request_success_total", finished_reason="error")
    results = asyncio.run(load())
    assert all(results) and all(f in ("stop", "length") for r in results for f in r), results
    assert [len(r) for r in results] == [2 if i % 4 == 1 else 1 for i in range(64)]
    assert server.metric("vllm:request_success_total", finished_reason="error") == errors
    server.wait_idle()
