"""The request fields a vLLM client sends: each takes effect, or is ignored with a line in the log."""

from __future__ import annotations

import json

import jsonschema

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
            "include_stop_str_in_output": False, "length_penalty": 1.0, "suffix": None,
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
