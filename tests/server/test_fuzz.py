"""Fuzzed request bodies, near-valid and not: never a 5xx, streams end with [DONE], the server stays up.

Every body that could be valid carries a tiny max_tokens, so the examples that do run cost a few steps.
"""

from __future__ import annotations

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import MODEL, Served

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
)
values = st.recursive(
    scalars | st.text(max_size=12),
    lambda v: st.lists(v, max_size=3) | st.dictionaries(st.text(max_size=6), v, max_size=3),
    max_leaves=6,
)
words = st.text(st.characters(codec="utf-8"), max_size=16)
NO_ARGS = {"type": "object", "properties": {}}
INT_ARG = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def function(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


user = st.fixed_dictionaries({"role": st.just("user"), "content": words})
turn = st.fixed_dictionaries(
    {"role": st.sampled_from(["assistant", "system", "developer"]), "content": words}
)
messages = st.tuples(st.lists(turn, max_size=2), user).map(lambda t: [*t[0], t[1]])
# Valid values only: the mutations below break them one field at a time.
sampling = {
    "model": st.just(MODEL),
    "max_tokens": st.integers(1, 3),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "n": st.integers(1, 2),
    "seed": st.integers(0, 2**31),
    "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "stream": st.booleans(),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "logit_bias": st.dictionaries(st.sampled_from(["1", "5", "300"]), st.floats(-100, 100), max_size=2),
    "ignore_eos": st.booleans(),
}
chat_fields = {
    **sampling,
    "logprobs": st.booleans(),
    "tools": st.sampled_from([[function("f", NO_ARGS)], [function("f", INT_ARG), function("g", NO_ARGS)]]),
    "tool_choice": st.sampled_from(
        ["auto", "none", "required", {"type": "function", "function": {"name": "f"}}]
    ),
    "response_format": st.sampled_from(
        [
            {"type": "text"},
            {"type": "json_object"},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "boolean"}}},
        ]
    ),
    "reasoning_effort": st.sampled_from(["low", "high", "max"]),
    "chat_template_kwargs": st.fixed_dictionaries({"thinking": st.booleans()}),
}
completion_fields = {**sampling, "logprobs": st.integers(0, 5), "echo": st.booleans()}
valid_chat = st.fixed_dictionaries(
    {"messages": messages, "max_tokens": st.integers(1, 3)},
    optional={k: v for k, v in chat_fields.items() if k != "max_tokens"},
)
valid_completion = st.fixed_dictionaries(
    {
        "prompt": st.text(min_size=1, max_size=16) | st.lists(st.integers(3, 4000), min_size=1, max_size=4),
        "max_tokens": st.integers(1, 3),
    },
    optional={k: v for k, v in completion_fields.items() if k != "max_tokens"},
)


@st.composite
def mutated(draw: st.DrawFn, bodies: st.SearchStrategy[dict], fields: list[str], cap: str | None) -> dict:
    """A valid body with one field set to an arbitrary value (or dropped, or an unknown one added);
    `cap` is the field that bounds the completion when max_tokens is gone."""
    body = draw(bodies)
    key = draw(
        st.sampled_from(
            [
                *fields,
                "messages",
                "prompt",
                "tool_choice",
                "top_logprobs",
                "stream_options",
                "suffix",
                "best_of",
                "max_completion_tokens",
                "unknown",
            ]
        )
    )
    if draw(st.booleans()) and key in body:
        del body[key]
    else:
        body[key] = draw(values)
    # Whatever may run must stay short; without max_tokens chat runs to the end of the context.
    if "max_tokens" in body and body["max_tokens"] is None:
        del body["max_tokens"]
    if "max_tokens" not in body and cap is not None:
        body.setdefault(cap, 2)
    if isinstance(body.get("max_tokens"), int) and not 0 < body["max_tokens"] < 4:
        body["max_tokens"] = draw(st.sampled_from([0, -1, 10**12]))
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 10**6
    return body


chat_bodies = valid_chat | mutated(valid_chat, list(chat_fields), "max_completion_tokens") | values
completion_bodies = valid_completion | mutated(valid_completion, list(completion_fields), None) | values


def post(server: Served, path: str, body: object) -> None:
    with server.http().stream("POST", path, json=body) as r:
        text = r.read().decode()
    assert r.status_code < 500, (body, text)
    if r.status_code != 200:
        assert "error" in r.json(), text
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert text.endswith("data: [DONE]\n\n"), text


@SETTINGS
@given(body=chat_bodies | values)
def test_fuzzed_chat_requests(server: Served, body: object):
    post(server, "/v1/chat/completions", body)


@SETTINGS
@given(body=completion_bodies | values)
def test_fuzzed_completion_requests(server: Served, body: object):
    post(server, "/v1/completions", body)


@settings(max_examples=30, deadline=None)
@given(raw=st.binary(max_size=64))
def test_fuzzed_raw_bodies(server: Served, raw: bytes):
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
        r = server.http().post(path, content=raw)
        assert r.status_code == 400 and "error" in r.json()


def test_server_is_healthy_after_the_fuzzing(server: Served):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert server.client().completions.create(model=MODEL, prompt="still here", max_tokens=2).choices
    server.wait_idle()
