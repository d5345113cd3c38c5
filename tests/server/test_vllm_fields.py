"""The request fields a vLLM client sends: each takes effect, or is ignored with a line in the log."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.server.conftest import MODEL, Served

USER = {"role": "user", "content": "Hi"}
FORCED = 100  # logit_bias makes greedy decoding pick this token whenever it may


def completion(server: Served, **fields: object) -> dict:
    body = {
        "model": MODEL,
        "prompt": "Hello",
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        **fields,
    }
    r = server.http().post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_unknown_fields_are_ignored_and_logged(server: Served):
    r = server.http().post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [USER],
            "max_tokens": 2,
            "frobnicate": 1,
            "metadata": {"k": "v"},
            "store": False,
            "service_tier": "auto",
        },  # fmt: skip
    )
    assert r.status_code == 200, r.text
    assert (
        "ignoring unknown request fields: frobnicate, metadata, service_tier, store" in server.log.read_text()
    )


def test_stop_token_ids_and_min_tokens(server: Served):
    forced = {"logit_bias": {str(FORCED): 100}}
    assert completion(server, **forced)["usage"]["completion_tokens"] == 6
    stopped = completion(server, stop_token_ids=[FORCED], **forced)
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] == 1
    held = completion(server, stop_token_ids=[FORCED], min_tokens=4, **forced)
    # The stop token is banned for the first 4 tokens, then the bias picks it at once.
    assert held["choices"][0]["finish_reason"] == "stop" and held["usage"]["completion_tokens"] == 5


def test_skip_special_tokens(server: Served):
    special = "<｜User｜>"
    ids = (
        server.http()
        .post("/tokenize", json={"prompt": special, "add_special_tokens": False})
        .json()["tokens"]
    )
    assert len(ids) == 1
    forced = {"logit_bias": {str(ids[0]): 100}, "max_tokens": 2}
    assert special not in completion(server, **forced)["choices"][0]["text"]
    assert completion(server, skip_special_tokens=False, **forced)["choices"][0]["text"] == special * 2


def test_guided_json_and_structured_outputs_constrain_the_output(server: Served):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["a"], "additionalProperties": False}  # fmt: skip
    for fields in ({"guided_json": schema}, {"structured_outputs": {"json": schema}}):
        r = server.http().post(
            "/v1/chat/completions", json={"model": MODEL, "messages": [USER], "max_tokens": 40, **fields}
        )
        assert r.status_code == 200, r.text
        jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), schema)


def test_chat_template_kwargs_as_vllm_sends_them(server: Served):
    def tokens(**fields: object) -> list[int]:
        return server.http().post("/tokenize", json={"messages": [USER], **fields}).json()["tokens"]

    vllm_form = tokens(chat_template_kwargs={"thinking": True, "reasoning_effort": "high"})
    assert vllm_form == tokens(reasoning_effort="high") != tokens()
    assert tokens(add_generation_prompt=False) != tokens()


def test_reasoning_comes_under_both_names(server: Served):
    body = {"model": MODEL, "messages": [USER], "max_tokens": 6, "chat_template_kwargs": {"thinking": True}}
    message = server.http().post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"]
    chunks = server.http().post("/v1/chat/completions", json={**body, "stream": True}).text.splitlines()
    deltas = [json.loads(c[6:])["choices"][0]["delta"] for c in chunks if c.startswith("data: {")]
    reasoning = [d for d in deltas if "reasoning_content" in d]
    assert reasoning and all(d["reasoning"] == d["reasoning_content"] for d in reasoning)


def test_neutral_values_of_unsupported_fields_are_accepted(server: Served):
    body = {"model": MODEL, "messages": [USER], "max_tokens": 2, "use_beam_search": False, "echo": False,
            "length_penalty": 1.0, "suffix": None,
            "prompt_logprobs": None, "chat_template": None, "continue_final_message": None}  # fmt: skip
    assert server.http().post("/v1/chat/completions", json=body).status_code == 200


def test_generation_config_defaults_fill_only_the_unset_fields():
    from engine.server.protocol import ChatCompletionRequest

    defaults = {"temperature": 0.3, "top_p": 0.8, "top_k": 20}
    unset = ChatCompletionRequest.model_validate({"messages": [USER]})
    params = unset.sampling_params(4, None, 0, defaults)
    assert (params.temperature, params.top_p, params.top_k) == (0.3, 0.8, 20)
    given = ChatCompletionRequest.model_validate({"messages": [USER], "temperature": 1.0, "top_k": -1})
    params = given.sampling_params(4, None, 0, defaults)
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 0.8, 0)
    nulls = ChatCompletionRequest.model_validate({"messages": [USER], "temperature": None, "top_k": None})
    params = nulls.sampling_params(4, None, 0, defaults)  # null is unset: the defaults fill it
    assert (params.temperature, params.top_p, params.top_k) == (0.3, 0.8, 20)


def test_a_thinking_budget_closes_the_reasoning_and_the_answer_follows(server: Served):
    body = {"model": MODEL, "messages": [USER], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "chat_template_kwargs": {"thinking": True}}  # fmt: skip
    unlimited = server.http().post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    budgeted = server.http().post("/v1/chat/completions", json={**body, "thinking_budget": 3}).json()
    message = budgeted["choices"][0]["message"]
    assert (
        message["reasoning"] == unlimited["reasoning"][: len(message["reasoning"])]
    )  # same start, cut short
    assert message["content"] and budgeted["usage"]["completion_tokens"] == 12
    refused = server.http().post(
        "/v1/chat/completions", json={**body, "chat_template_kwargs": {}, "thinking_budget": 3}
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "thinking_budget"


def test_continuous_usage_stats_give_every_chunk_the_usage_so_far(server: Served):
    for path, fields in (
        ("/v1/chat/completions", {"messages": [USER]}),
        ("/v1/completions", {"prompt": "Hi"}),
    ):
        body = {"model": MODEL, "max_tokens": 5, "ignore_eos": True, "stream": True, **fields,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
        lines = server.http().post(path, json=body).text.splitlines()
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        *chunks, last = events
        assert not last["choices"] and last["usage"]["completion_tokens"] == 5
        counts = [c["usage"]["completion_tokens"] for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 5, counts
        assert all(c["usage"]["prompt_tokens"] == last["usage"]["prompt_tokens"] for c in chunks)


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
# vLLM's request models allow extras at every level: each is ignored, named once in the log.
NESTED_EXTRAS = {
    "stream_options.x": {"stream": True, "stream_options": {"include_usage": True, "x": 1}},
    "response_format.x": {"response_format": {"type": "json_object", "x": 1}},
    "response_format.json_schema.x": {
        "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {}, "x": 1}}
    },
    "tool_choice.function.x": {
        "tools": [TOOL],
        "tool_choice": {"type": "function", "function": {"name": "f", "x": 1}},
    },
    "tool_choice.x": {
        "tools": [TOOL],
        "tool_choice": {"type": "function", "function": {"name": "f"}, "x": 1},
    },
    "chat_template_kwargs.enable_thinking": {"chat_template_kwargs": {"enable_thinking": False}},
}


@pytest.mark.parametrize(("named", "fields"), NESTED_EXTRAS.items(), ids=NESTED_EXTRAS.keys())
def test_extra_keys_in_nested_objects_are_ignored_and_logged(server: Served, named: str, fields: dict):
    body = {"model": MODEL, "messages": [USER], "max_tokens": 2, **fields}
    r = server.http().post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert f"ignoring unknown request fields: {named}" in server.log.read_text()


# What common client libraries put in messages and content parts: ignored (logged), so the prompt is the one
# the plain messages give.
MESSAGE_EXTRAS = {
    "messages[].cache_control": [{**USER, "cache_control": {"type": "ephemeral"}}],
    "messages[].content[].cache_control": [
        {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]}
    ],
    "messages[].annotations, messages[].audio, messages[].refusal": [
        USER,
        {"role": "assistant", "content": "Hello", "refusal": "no", "annotations": [], "audio": {"id": "a"}},
        USER,
    ],
    "messages[].tool_calls[].index": [
        USER,
        {"role": "assistant", "tool_calls": [{**CALL, "index": 0}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "r"},
    ],
    "messages[].tool_calls[].function.strict": [
        USER,
        {"role": "assistant", "tool_calls": [{**CALL, "function": {**CALL["function"], "strict": True}}]},
    ],
}
PLAIN = [
    [USER],
    [USER],
    [USER, {"role": "assistant", "content": "Hello"}, USER],
    [
        USER,
        {"role": "assistant", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "r"},
    ],
    [USER, {"role": "assistant", "tool_calls": [CALL]}],
]


def _tokens(server: Served, messages: list) -> list[int]:
    r = server.http().post("/tokenize", json={"messages": messages, "tools": [TOOL]})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


@pytest.mark.parametrize(
    ("named", "messages", "plain"),
    [
        (named, messages, plain)
        for (named, messages), plain in zip(MESSAGE_EXTRAS.items(), PLAIN, strict=True)
    ],
    ids=MESSAGE_EXTRAS.keys(),
)
def test_extra_keys_in_messages_are_ignored_and_logged(
    server: Served, named: str, messages: list, plain: list
):
    assert _tokens(server, messages) == _tokens(server, plain)
    assert f"ignoring unknown message fields: {named}" in server.log.read_text()


# vLLM reads every text-carrying part type as text.
TEXT_PARTS = {
    "input_text": {"type": "input_text", "text": "Hi"},
    "output_text": {"type": "output_text", "text": "Hi"},
    "refusal": {"type": "refusal", "refusal": "Hi"},
}


@pytest.mark.parametrize("part", TEXT_PARTS.values(), ids=TEXT_PARTS.keys())
def test_every_text_part_type_is_text(server: Served, part: dict):
    for role in ("user", "assistant"):
        given = [USER, {"role": role, "content": [part]}, USER]
        assert _tokens(server, given) == _tokens(server, [USER, {"role": role, "content": "Hi"}, USER])
    r = server.http().post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": [part]}], "max_tokens": 2},
    )
    assert r.status_code == 200, r.text


def _stream_text(server: Served, path: str, body: dict) -> str:
    lines = server.http().post(path, json={**body, "stream": True}).text.splitlines()
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    key = "text" if path == "/v1/completions" else "content"
    return "".join(
        (c["text"] if key == "text" else c["delta"].get("content") or "")
        for e in events
        for c in e["choices"]
    )


STOP_PATHS = {
    "completions": ("/v1/completions", {"prompt": "Hello"}),
    "chat": ("/v1/chat/completions", {"messages": [USER]}),
}


@pytest.mark.parametrize(("path", "fields"), STOP_PATHS.values(), ids=STOP_PATHS.keys())
def test_include_stop_str_in_output_ends_the_text_after_the_stop_string(
    server: Served, path: str, fields: dict
):
    body = {"model": MODEL, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **fields}

    def text(**extra: object) -> tuple[str, str]:
        r = server.http().post(path, json={**body, **extra})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["text"] if "text" in choice else choice["message"]["content"], choice["finish_reason"]

    free, _ = text()
    stop = free[4:7]
    cut, reason = text(stop=[stop])
    kept, kept_reason = text(stop=[stop], include_stop_str_in_output=True)
    assert reason == kept_reason == "stop" and kept == cut + stop and free.startswith(kept)
    assert _stream_text(server, path, {**body, "stop": [stop], "include_stop_str_in_output": True}) == kept
