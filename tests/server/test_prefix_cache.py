"""A repeated chat prefix is served from the prefix cache: usage reports the cached prompt tokens, and
vLLM's prefix-cache counters count what was looked up and found."""

from __future__ import annotations

from tests.server.conftest import MODEL, Served

PAGE = 256  # the server's default page size
SYSTEM = " ".join(f"rule {i}: answer briefly and politely." for i in range(60))


def test_a_repeated_system_prompt_is_cached_and_reported(server: Served):
    client = server.client()
    server.wait_idle()
    queries = server.metric("vllm:prefix_cache_queries_total", model_name=MODEL)
    hits = server.metric("vllm:prefix_cache_hits_total", model_name=MODEL)

    def ask(question: str, **kwargs):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **kwargs)

    first = ask("What is one plus one?")
    assert first.usage.prompt_tokens > PAGE + 1
    second = ask("And two plus two?")
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Both prompts share the system prompt: at least its first page, never the whole prompt.
    assert cached % PAGE == 0 and PAGE <= cached < second.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens <= cached
    stream = ask("And three plus three?", stream=True, stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage][-1]
    assert usage.prompt_tokens_details.cached_tokens == cached
    server.wait_idle()
    prompts = first.usage.prompt_tokens + second.usage.prompt_tokens + usage.prompt_tokens
    found = first.usage.prompt_tokens_details.cached_tokens + 2 * cached
    assert server.metric("vllm:prefix_cache_queries_total", model_name=MODEL) - queries == prompts
    assert server.metric("vllm:prefix_cache_hits_total", model_name=MODEL) - hits == found


def test_responses_report_their_cached_input_tokens(server: Served):
    client = server.client()
    replies = [
        client.responses.create(model=MODEL, instructions=SYSTEM, input=question, max_output_tokens=2)
        for question in ("Name a colour.", "Name a fruit.")
    ]
    cached = replies[1].usage.input_tokens_details.cached_tokens
    assert cached % PAGE == 0 and PAGE <= cached < replies[1].usage.input_tokens
