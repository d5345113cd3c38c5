"""The server through the official `openai` client: models, completions, chat (streaming and not), tools,
n, stop strings, logprobs and usage."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from model.chat import encode_messages
from model.chat_profile import V41
from model.tokenizer import load_tokenizer
from tests.server.conftest import API_KEY, MODEL, Served

HELLO = [{"role": "user", "content": "Hello there"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}


def test_models_health_auth_and_unknown_model(server: Served):
    assert [m.id for m in server.client().models.list().data] == [MODEL, "other"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    denied = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer wrong"})
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as err:
        server.client().completions.create(model="gpt-4", prompt="Hi", max_tokens=1)
    assert err.value.body["code"] == "model_not_found"


def test_completion_usage_logprobs_and_echo(server: Served):
    client = server.client()
    prompt_ids = server.http().post("/tokenize", json={"prompt": "The quick brown fox"}).json()["tokens"]
    out = client.completions.create(
        model=MODEL,
        prompt="The quick brown fox",
        max_tokens=4,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    choice = out.choices[0]
    assert out.object == "text_completion" and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(prompt_ids) and out.usage.completion_tokens == 4
    assert out.usage.total_tokens == len(prompt_ids) + 4
    assert len(choice.logprobs.tokens) == 4 and "".join(choice.logprobs.tokens) == choice.text
    assert all(
        len(top) == 2 and max(top.values()) >= lp - 1e-6
        for top, lp in zip(choice.logprobs.top_logprobs, choice.logprobs.token_logprobs, strict=True)
    )
    echoed = client.completions.create(
        model=MODEL,
        prompt="The quick brown fox",
        max_tokens=4,
        temperature=0,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    assert echoed.choices[0].text == "The quick brown fox" + choice.text
    by_ids = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text.startswith(choice.text) or choice.text.startswith(by_ids.choices[0].text)
    detok = server.http().post("/detokenize", json={"tokens": prompt_ids}).json()["prompt"]
    assert detok.endswith("The quick brown fox")


def test_chat_stream_concatenates_to_the_non_streamed_reply(server: Served):
    client = server.client()
    kwargs = {"model": MODEL, "messages": HELLO, "max_tokens": 8, "temperature": 0, "logprobs": True}
    full = client.chat.completions.create(**kwargs, top_logprobs=1)
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    message = full.choices[0].message
    assert full.object == "chat.completion" and chunks[1].object == "chat.completion.chunk"
    assert text == message.content and finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert all(c.usage is None for c in chunks[:-1])
    assert full.usage.completion_tokens == len(full.choices[0].logprobs.content) <= 8
    assert full.usage.prompt_tokens == len(
        server.http().post("/tokenize", json={"messages": HELLO}).json()["tokens"]
    )
    streamed_logprobs = [
        t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content
    ]
    assert [t.token for t in streamed_logprobs] == [t.token for t in full.choices[0].logprobs.content]
    # The SSE framing itself: every event is `data: <json>`, the last `data: [DONE]`.
    raw = server.http().post("/v1/chat/completions", json={**kwargs, "stream": True}).text
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: {") for e in events[:-1])


def test_n_choices_and_seeds(server: Served):
    client = server.client()
    out = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=4, n=2, seed=7, temperature=1.0
    )
    assert [c.index for c in out.choices] == [0, 1]
    again = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, n=2, seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]
    assert out.choices[0].message.content != out.choices[1].message.content  # seed + index per choice
    stream = client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=3, n=2, stream=True)
    finished = sorted(c.choices[0].index for c in stream if c.choices[0].finish_reason)
    assert finished == [0, 1, 2, 3]


def test_stop_strings_cut_the_text_streamed_or_not(server: Served):
    client = server.client()
    base = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "temperature": 0,
        "max_tokens": 12,
        "extra_body": {"ignore_eos": True},
    }
    free = client.completions.create(**base).choices[0].text
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    cut = client.completions.create(**base, stop=[stop, "never matches"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == free[: free.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(**base, stop=stop, stream=True))
    assert streamed == cut.choices[0].text


def test_tool_call_round_trip(server: Served):
    client = server.client()
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice=forced, max_tokens=160, temperature=0
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert args["city"] in ("Paris", "Oslo", "Lima") and 1 <= args["days"] <= 7
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER],
        tool_choice=forced,
        max_tokens=160,
        temperature=0,
        stream=True,
    )
    deltas = [c.choices[0].delta for c in stream if c.choices]
    streamed = [t for d in deltas for t in d.tool_calls or []]
    assert [(t.function.name, t.function.arguments) for t in streamed] == [
        ("get_weather", call.function.arguments)
    ]
    # The reply goes back as the client returned it, with the tool's result.
    messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    rendered = server.http().post(
        "/tokenize",
        json={
            "messages": [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages],
            "tools": [WEATHER],
            "return_token_strs": True,
        },
    )
    assert rendered.status_code == 200 and "<tool_result>" in rendered.json()["token_strs"]
    bad = [*messages[:-1], {"role": "tool", "tool_call_id": "call_nope", "content": "x"}]
    with pytest.raises(openai.BadRequestError, match="matches no call"):
        client.chat.completions.create(model=MODEL, messages=bad, tools=[WEATHER], max_tokens=4)


def test_required_tool_choice_and_tool_choice_none(server: Served):
    client = server.client()
    noop = {
        "type": "function",
        "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}},
    }
    out = client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        tools=[WEATHER, noop],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=160,
        temperature=0,
    )
    assert out.choices[0].finish_reason == "tool_calls" and len(out.choices[0].message.tool_calls) == 1
    plain = client.chat.completions.create(
        model=MODEL, messages=HELLO, tools=[WEATHER], tool_choice="none", max_tokens=4, temperature=0
    )
    assert plain.choices[0].message.tool_calls is None


def test_thinking_mode_splits_reasoning_from_content(server: Served):
    client = server.client()
    kwargs = {
        "model": MODEL,
        "messages": HELLO,
        "max_tokens": 6,
        "temperature": 0,
        "reasoning_effort": "high",
    }
    full = client.chat.completions.create(**kwargs).choices[0].message
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    reasoning = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert reasoning == full.reasoning_content and content == full.content
    assert full.reasoning_content  # the tiny model never closes its reasoning in 6 tokens
    off = client.chat.completions.create(**kwargs, extra_body={"chat_template_kwargs": {"thinking": False}})
    assert getattr(off.choices[0].message, "reasoning_content", None) is None


def test_disconnect_aborts_and_frees_the_cache(server: Served):
    def aborted() -> float:
        return server.metric("vllm:request_success_total", finished_reason="abort")

    def wait_for_abort(before: float) -> None:
        deadline = time.monotonic() + 10
        while aborted() == before:
            assert time.monotonic() < deadline, "the request was not aborted"
            time.sleep(0.1)
        server.wait_idle()

    long = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 400, "ignore_eos": True}
    before = aborted()
    with server.http().stream("POST", "/v1/completions", json={**long, "stream": True}) as response:
        assert next(line for line in response.iter_lines() if line).startswith("data: {")
    wait_for_abort(before)
    before = aborted()
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
        server.http().post("/v1/completions", json=long, timeout=1.0)
    wait_for_abort(before)
    assert aborted() == before + 1


def test_api_key_is_required_for_every_api_route(server: Served):
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        r = httpx.post(f"{server.url}{path}", json={})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert (
        httpx.post(
            f"{server.url}/tokenize", json={"prompt": "x"}, headers={"Authorization": f"Bearer {API_KEY}"}
        ).status_code
        == 200
    )


def test_the_tiny_v41_renders_with_the_v41_encoding(server: Served):
    assert "Chat encoding: v41" in server.log.read_text()
    tokenizer = load_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, *HELLO]

    def rendered(**fields: object) -> list[int]:
        reply = server.http().post("/tokenize", json={"messages": messages, **fields})
        assert reply.status_code == 200, reply.text
        return reply.json()["tokens"]

    def encoded(**kwargs: object) -> list[int]:
        return tokenizer.encode(encode_messages(messages, **kwargs), add_special_tokens=False).ids

    assert rendered() == encoded(profile=V41) != encoded()  # the default is V4's
    assert rendered(tools=[WEATHER]) == encoded(profile=V41, tools=[WEATHER])
    # OpenAI's effort names map onto V4.1's budgets; its own values pass; none is chat mode.
    assert rendered(reasoning_effort="medium") == encoded(profile=V41, thinking=True, reasoning_effort="high")
    assert rendered(reasoning_effort="xhigh") == encoded(profile=V41, thinking=True, reasoning_effort=100)
    # An integer budget is V4.1's own value, given where vLLM's DeepSeek-V4 form puts it.
    budget = encoded(profile=V41, thinking=True, reasoning_effort=30)
    assert rendered(chat_template_kwargs={"reasoning_effort": 30}) == budget
    assert rendered(reasoning_effort="none") == encoded(profile=V41)
    thinking_on = {"chat_template_kwargs": {"thinking": True}}
    for bad in ({"reasoning_effort": "extreme"}, {"reasoning_effort": 30},
                {"chat_template_kwargs": {"reasoning_effort": 0}},
                {"chat_template_kwargs": {"reasoning_effort": 101}},
                {"reasoning_effort": "none", **thinking_on}):  # fmt: skip
        reply = server.http().post("/tokenize", json={"messages": messages, **bad})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "reasoning_effort"


def test_version_ping_and_one_model(server: Served):
    http = server.http()
    assert http.get("/version").json()["version"]
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
    card = http.get("/v1/models/other").json()
    assert card["id"] == "other" and card["object"] == "model"
    missing = http.get("/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
