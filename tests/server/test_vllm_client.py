"""A client script written for vLLM's DeepSeek-V4 server runs unchanged against this one: thinking through
`chat_template_kwargs`, tools with `tool_choice="auto"`, `stream_options.include_usage`, and the extra
fields vLLM takes (`metadata`, `stop_token_ids`, `skip_special_tokens`)."""

from __future__ import annotations

from tests.server.conftest import MODEL, Served

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_a_vllm_client_script_runs_unchanged(server: Served):
    client = server.client()  # the OpenAI SDK, as a vLLM user points it at vLLM
    thinking = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is 17*19?"}],
        max_tokens=8,
        extra_body={
            "chat_template_kwargs": {"thinking": True, "reasoning_effort": "high"},
            "metadata": {"user": "42"},
            "stop_token_ids": [1],
            "skip_special_tokens": True,
        },  # fmt: skip
    )
    message = thinking.choices[0].message.model_dump()
    assert "reasoning_content" in message and "reasoning" in message
    tools = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
        tool_choice="auto", max_tokens=8,
    )  # fmt: skip
    assert tools.choices[0].finish_reason in ("stop", "length", "tool_calls")
    usage = None
    for chunk in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True},
    ):  # fmt: skip
        usage = chunk.usage or usage
    assert usage is not None and usage.completion_tokens <= 4
    # vLLM logs the fields it does not know; so does this server (the SDK's own fields are known).
    assert "ignoring unknown request fields: metadata" in server.log.read_text()
