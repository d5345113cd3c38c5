"""64 concurrent streaming chat requests against the tiny model: all complete, and /metrics counts them."""

from __future__ import annotations

import asyncio
import time

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
        "ok": count("deepseek_http_requests_total", endpoint="/v1/chat/completions", status="200"),
        "length": count("deepseek_requests_finished_total", finish_reason="length"),
        "generated": count("deepseek_generation_tokens_total"),
        "ttft": count("deepseek_time_to_first_token_seconds_count"),
        "e2e": count("deepseek_e2e_request_latency_seconds_count"),
        "drafted": count("deepseek_spec_decode_draft_tokens_total"),
    }
    start = time.monotonic()
    results = asyncio.run(load(server.url))
    elapsed = time.monotonic() - start
    assert [(finish, n) for _, finish, n in results] == [("length", MAX_TOKENS)] * CONCURRENCY
    assert all(text for text, _, _ in results)
    assert (
        count("deepseek_http_requests_total", endpoint="/v1/chat/completions", status="200")
        == before["ok"] + 64
    )
    assert count("deepseek_requests_finished_total", finish_reason="length") == before["length"] + 64
    assert count("deepseek_generation_tokens_total") == before["generated"] + 64 * MAX_TOKENS
    assert count("deepseek_time_to_first_token_seconds_count") == before["ttft"] + 64
    assert count("deepseek_e2e_request_latency_seconds_count") == before["e2e"] + 64
    server.wait_idle()
    # Every request decodes 3 tokens after its first, each step verifying up to 2 DSpark drafts.
    assert count("deepseek_spec_decode_draft_tokens_total") >= before["drafted"] + 64 * 2
    accepted = count("deepseek_spec_decode_accepted_tokens_total")
    assert 0 <= accepted <= count("deepseek_spec_decode_draft_tokens_total")
    assert count("deepseek_spec_decode_mean_accepted_length") >= 1.0
    assert 0 <= count("deepseek_spec_decode_acceptance_rate", position="0") <= 1
    print(f"64 concurrent streams of {MAX_TOKENS} tokens: {elapsed:.1f} s")
