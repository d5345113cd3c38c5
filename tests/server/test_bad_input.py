"""Every defect of a request is an OpenAI-style error with a 4xx status, never a 5xx, and the server keeps
serving."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MAX_MODEL_LEN, MODEL, Served

USER = {"role": "user", "content": "Hi"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def chat(**fields: object) -> dict:
    return {"model": MODEL, "messages": [USER], "max_tokens": 2, **fields}


CHAT_400 = {
    "messages not a list": chat(messages={"role": "user"}),
    "no messages": {"model": MODEL, "max_tokens": 2},
    "empty messages": chat(messages=[]),
    "message not an object": chat(messages=["hi"]),
    "unknown role": chat(messages=[{"role": "robot", "content": "hi"}]),
    "content block not an object": chat(messages=[{"role": "user", "content": ["hi"]}]),
    "content block without text": chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
    "content of the wrong type": chat(messages=[{"role": "user", "content": 5}]),
    "reserved token in content": chat(messages=[{"role": "user", "content": "<｜User｜>"}]),
    "duplicate tool call ids": chat(messages=[USER, {"role": "assistant", "tool_calls": [CALL, CALL]}]),
    "unmatched tool result": chat(
        messages=[
            USER,
            {"role": "assistant", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "x", "content": "1"},
        ]
    ),
    "tool result without a call": chat(
        messages=[USER, {"role": "tool", "tool_call_id": "x", "content": "1"}]
    ),
    "arguments not JSON": chat(
        messages=[
            USER,
            {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{oops"}}]},
        ]
    ),
    "json_schema without schema": chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
    "temperature too high": chat(temperature=2.5),
    "top_p out of range": chat(top_p=1.5),
    "top_p zero": chat(top_p=0),
    "negative max_tokens": chat(max_tokens=-1),
    "max_tokens over the context": chat(max_tokens=MAX_MODEL_LEN * 2),
    "prompt over the context": chat(messages=[{"role": "user", "content": "word " * MAX_MODEL_LEN * 2}]),
    "n zero": chat(n=0),
    "n as a string": chat(n="2"),
    "top_logprobs without logprobs": chat(top_logprobs=2),
    "top_logprobs too many": chat(logprobs=True, top_logprobs=50),
    "presence penalty out of range": chat(presence_penalty=3),
    "stop not strings": chat(stop=[1, 2]),
    "empty stop string": chat(stop=[""]),
    "stream_options without stream": chat(stream_options={"include_usage": True}),
    "tool_choice without tools": chat(tool_choice="required"),
    "unknown tool named": chat(tools=[F], tool_choice={"type": "function", "function": {"name": "g"}}),
    "tools not a list": chat(tools={"type": "function"}),
    "bad tool": chat(tools=[{"type": "function"}]),
    "bad reasoning effort": chat(reasoning_effort="extreme"),
    "logit bias on a non-token": chat(logit_bias={"abc": 1}),
    "logit bias out of range": chat(logit_bias={"5": 1000}),
    "max_tokens and max_completion_tokens disagree": chat(max_tokens=2, max_completion_tokens=3),
    "schema with a forced tool": chat(
        tools=[F], tool_choice="required", response_format={"type": "json_object"}
    ),
}
COMPLETION_400 = {
    "empty prompt": {"model": MODEL, "prompt": ""},
    "token out of the vocabulary": {"model": MODEL, "prompt": [1, 2, 10**9]},
    "negative token": {"model": MODEL, "prompt": [-1]},
    "prompt of the wrong type": {"model": MODEL, "prompt": {"text": "x"}},
    "suffix": {"model": MODEL, "prompt": "x", "suffix": "y"},
    "best_of": {"model": MODEL, "prompt": "x", "best_of": 3},
    "logprobs too many": {"model": MODEL, "prompt": "x", "logprobs": 30},
}


@pytest.mark.parametrize("body", CHAT_400.values(), ids=CHAT_400.keys())
def test_chat_defects_are_400(server: Served, body: dict):
    r = server.http().post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]


@pytest.mark.parametrize("body", COMPLETION_400.values(), ids=COMPLETION_400.keys())
def test_completion_defects_are_400(server: Served, body: dict):
    r = server.http().post("/v1/completions", json=body)
    assert r.status_code == 400, r.text


@pytest.mark.parametrize(
    "raw",
    [
        b"{",
        b"[1, 2]",
        b'"text"',
        b"",
        b"\xff\xfe",
        b'{"a": NaN}',
        b'{"model": "x", "model": "y"}',
        b"[" * 100_000,
    ],
)
def test_bodies_that_are_not_a_json_object_are_400(server: Served, raw: bytes):
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
        r = server.http().post(path, content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "error" in r.json(), (path, r.text)


def test_unknown_routes_and_methods_get_error_objects(server: Served):
    assert server.http().get("/v1/nothing").json()["error"]["type"] == "NotFoundError"
    r = server.http().get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()
    assert server.http().post("/detokenize", json={"tokens": [5000000]}).status_code == 400
    assert httpx.get(f"{server.url}/health").status_code == 200
