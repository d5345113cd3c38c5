"""`response_format`: JSON output enforced by constrained decoding. The tiny model writes random text, so
only a real constraint makes these parse and validate."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from tests.server.conftest import MODEL, Served

SHORT = {"type": "string", "maxLength": 6}


def obj(**properties: dict) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def integer(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


SCHEMAS = [
    obj(name=SHORT, age=integer(0, 120)),
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    obj(color={"enum": ["red", "green", "blue"]}),
    integer(-50, 50),
    obj(ok={"type": "boolean"}, tags={"type": "array", "items": SHORT, "maxItems": 2}),
    {"type": "string", "pattern": "^[a-z]{2,5}-[0-9]{1,3}$"},
    obj(point=obj(x=integer(0, 9), y=integer(0, 9))),
    {"anyOf": [{"type": "null"}, {"type": "boolean"}]},
    # multipleOf bounds the digits: a greedy random model may otherwise write 1.0000... to the limit.
    obj(kind={"const": "circle"}, r={"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25}),
    {"type": "array", "prefixItems": [integer(1, 3), {"enum": ["a", "b"]}], "items": False, "minItems": 2},
]


def ask(server: Served, schema: dict, stream: bool) -> tuple[str, str]:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    client = server.client()
    kwargs = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Answer in JSON."}],
        "max_tokens": 60,
        "temperature": 0,
        "response_format": fmt,
    }
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content, choice.finish_reason
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    return text, chunks[-1].choices[0].finish_reason


def test_ten_json_schemas_parse_and_validate(server: Served):
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        results = list(pool.map(lambda s: ask(server, s, stream=False), SCHEMAS))
    for schema, (text, finish) in zip(SCHEMAS, results, strict=True):
        assert finish == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)
    assert ask(server, SCHEMAS[0], stream=True) == results[0]


def test_json_object_and_sampled_choices(server: Served):
    client = server.client()
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=40,
        n=2,
        seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMAS[2]}},
    )
    for choice in out.choices:
        assert json.loads(choice.message.content)["color"] in ("red", "green", "blue")
    obj = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=12,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert obj.choices[0].message.content.startswith("{")


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "json_schema", "json_schema": {"name": "x"}},  # no schema
        {"type": "json_schema"},
        {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "string", "format": "no-such"}},
        },
        {"type": "json_schema", "json_schema": {"name": "x", "schema": []}},
        {"type": "yaml"},
    ],
)
def test_bad_response_formats_are_400(server: Served, fmt: dict):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 2,
        "response_format": fmt,
    }
    r = server.http().post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
