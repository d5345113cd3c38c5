"""Hostile input, as a client out to break the server would send it: every case gets the expected 4xx with
an OpenAI-style error body that names the field at fault, never a 5xx; the log stays free of tracebacks,
no response is counted as a 5xx and /health is 200 afterwards.

Numbers go in as raw JSON text, so NaN, Infinity, 1e309 and integers beyond 64 bits reach the server as a
client would write them.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.server.conftest import API_KEY, MAX_MODEL_LEN, MODEL, Served

USER = {"role": "user", "content": "Hi"}
BAD = "\ud800"  # a lone surrogate: JSON can carry it (as \\ud800), UTF-8 cannot
FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
CHAT, COMPLETIONS, TOKENIZE = "/v1/chat/completions", "/v1/completions", "/tokenize"


@dataclass
class Case:
    path: str
    body: dict | str | bytes  # a dict is sent as JSON; text or bytes as the raw body
    status: int = 400
    param: str | None = None  # the error's param starts with this
    headers: dict[str, str | None] = field(default_factory=dict)  # None: leave the header out

    def raw(self) -> bytes:
        if isinstance(self.body, bytes):
            return self.body
        return (self.body if isinstance(self.body, str) else json.dumps(self.body)).encode()


def chat(**fields: object) -> dict:
    return {"model": MODEL, "messages": [USER], "max_tokens": 2, **fields}


def completion(**fields: object) -> dict:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **fields}


def with_literal(body: dict, name: str, literal: str) -> str:
    """`body` as JSON text with `name` set to the raw JSON token `literal` (NaN, 1e309, 2**70, ...)."""
    return json.dumps({**body, name: "@@"}).replace('"@@"', literal)


CASES: dict[str, Case] = {}

# ---- numbers: every numeric field against every kind of bad number -------------------------------------
NUMERIC = {
    "temperature": (CHAT, chat()),
    "top_p": (CHAT, chat()),
    "top_k": (CHAT, chat()),
    "min_p": (CHAT, chat()),
    "n": (CHAT, chat()),
    "seed": (CHAT, chat()),
    "presence_penalty": (CHAT, chat()),
    "frequency_penalty": (CHAT, chat()),
    "repetition_penalty": (CHAT, chat()),
    "max_tokens": (CHAT, chat()),
    "max_completion_tokens": (CHAT, {"model": MODEL, "messages": [USER]}),
    "top_logprobs": (CHAT, chat(logprobs=True)),
    "logprobs": (COMPLETIONS, completion()),
}
LITERALS = {
    "1e309": True,  # parses to inf: the field is named
    "-1e309": True,
    "1e999999": True,
    "NaN": False,  # not JSON at all: no field to name
    "Infinity": False,
    "-Infinity": False,
    str(2**70): True,
    '"1"': True,
    "true": True,
    "[]": True,
    "{}": True,
}
for name, (path, base) in NUMERIC.items():
    for literal, named in LITERALS.items():
        if name == "max_completion_tokens" and literal == "{}":
            continue
        CASES[f"{name}={literal}"] = Case(
            path, with_literal(base, name, literal), param=name if named else None
        )

# Integers longer than Python's int() takes (4300 digits) are out of range too, located as any other.
for sign in ("", "-"):
    CASES[f"seed of {sign}5000 digits"] = Case(
        CHAT, with_literal(chat(), "seed", sign + "9" * 5000), param="seed"
    )

# ---- ranges: finite numbers the sampler cannot use -----------------------------------------------------
RANGES = {
    "seed 2**64": chat(seed=2**64),
    "seed 10**100": chat(seed=10**100),
    "seed 2**64-1 with n=2": chat(seed=2**64 - 1, n=2),
    "seed below -2**63": chat(seed=-(2**63) - 1),
    "top_p 1e-46": chat(top_p=1e-46),
    "top_p negative": chat(top_p=-0.5),
    "repetition_penalty 1e-40": chat(repetition_penalty=1e-40),
    "repetition_penalty zero": chat(repetition_penalty=0),
    "repetition_penalty 11": chat(repetition_penalty=11),
    "temperature negative": chat(temperature=-1),
    "min_p 1.5": chat(min_p=1.5),
    "top_k -2": chat(top_k=-2),
    "n 17": chat(n=17),
    "n 1.5": chat(n=1.5),
    "max_tokens 0": chat(max_tokens=0),
    "max_tokens 1.5": chat(max_tokens=1.5),
    "frequency_penalty -2.5": chat(frequency_penalty=-2.5),
    "logprobs -1": completion(logprobs=-1),
    "logit_bias value 101": chat(logit_bias={"5": 101}),
    "logit_bias value string": chat(logit_bias={"5": "1"}),
}
for name, body in RANGES.items():
    key = name.split()[0]
    CASES[name] = Case(COMPLETIONS if "prompt" in body else CHAT, body, param=key)

# ---- logit_bias keys: ASCII decimal token ids of the vocabulary only -----------------------------------
for key in ["²", "٣", "１", "1" * 5000, "-1", "+1", " 1", "1.0", "0x10", "", "4096", str(2**64), "1e3"]:
    CASES[f"logit_bias key {key[:12]!r}"] = Case(CHAT, chat(logit_bias={key: 1}), param="logit_bias")
CASES["logit_bias 1025 entries"] = Case(
    CHAT, chat(logit_bias={str(t): 1 for t in range(1025)}), param="logit_bias"
)

# ---- types and shapes of the other fields --------------------------------------------------------------
TYPES = {
    "stream string": (CHAT, chat(stream="yes"), "stream"),
    "stream_options list": (CHAT, chat(stream=True, stream_options=[]), "stream_options"),
    "stream_options a string": (CHAT, chat(stream=True, stream_options="usage"), "stream_options"),
    "user number": (CHAT, chat(user=5), "user"),
    "model number": (CHAT, chat(model=5), "model"),
    "model unknown": (CHAT, chat(model="gpt-4"), "model"),
    "logprobs int on chat": (CHAT, chat(logprobs=3), "logprobs"),
    "ignore_eos string": (CHAT, chat(ignore_eos="true"), "ignore_eos"),
    "parallel_tool_calls int": (CHAT, chat(parallel_tool_calls=1), "parallel_tool_calls"),
    "use_beam_search": (CHAT, chat(use_beam_search=True), "use_beam_search"),
    "a chat template of its own": (CHAT, chat(chat_template="{{ messages }}"), "chat_template"),
    "guided_regex": (COMPLETIONS, completion(guided_regex="a+"), "guided_regex"),
    "min_tokens over max_tokens": (CHAT, chat(min_tokens=5), "min_tokens"),
    "stop_token_ids negative": (CHAT, chat(stop_token_ids=[-1]), "stop_token_ids"),
    "chat_template_kwargs thinking string": (
        CHAT,
        chat(chat_template_kwargs={"thinking": "on"}),
        "chat_template_kwargs",
    ),
    "reasoning_effort a list": (CHAT, chat(reasoning_effort=[3]), "reasoning_effort"),
    # OpenAI and vLLM type it a string; V4.1's integer budgets go in chat_template_kwargs.
    "reasoning_effort an integer": (CHAT, chat(reasoning_effort=5), "reasoning_effort"),
    "reasoning_effort a whole float": (CHAT, chat(reasoning_effort=50.0), "reasoning_effort"),
    "chat_template_kwargs reasoning_effort a list": (
        CHAT,
        chat(chat_template_kwargs={"reasoning_effort": [5]}),
        "chat_template_kwargs",
    ),
    "structured_outputs of another kind": (
        CHAT,
        chat(structured_outputs={"regex": "a+"}),
        "structured_outputs",
    ),
    "echo string": (COMPLETIONS, completion(echo="no"), "echo"),
    "prompt mixed list": (COMPLETIONS, completion(prompt=[1, "a"]), "prompt"),
    "prompt nested strings": (COMPLETIONS, completion(prompt=[["a"]]), "prompt"),
    "prompt float tokens": (COMPLETIONS, completion(prompt=[1.5]), "prompt"),
    "prompt bool tokens": (COMPLETIONS, completion(prompt=[True]), "prompt"),
    "prompt null": (COMPLETIONS, completion(prompt=None), "prompt"),
    "prompt empty list": (COMPLETIONS, completion(prompt=[]), "prompt"),
    "prompt list with an empty prompt": (COMPLETIONS, completion(prompt=["a", ""]), "prompt"),
    "prompt token 2**64": (COMPLETIONS, completion(prompt=[2**64]), "prompt"),
    "tokenize both": (TOKENIZE, {"prompt": "a", "messages": [USER]}, "prompt"),
    "tokenize neither": (TOKENIZE, {}, "prompt"),
    "detokenize strings": ("/detokenize", {"tokens": ["a"]}, "tokens"),
    "detokenize negative": ("/detokenize", {"tokens": [-1]}, "tokens"),
    "detokenize huge": ("/detokenize", {"tokens": [2**70]}, "tokens"),
}
for name, (path, body, param) in TYPES.items():
    CASES[name] = Case(path, body, 404 if name == "model unknown" else 400, param)

# ---- stop strings: capped in count and length ----------------------------------------------------------
STOPS = {
    "stop 100,000 strings": chat(stop=["a"] * 100_000),
    "stop 17 strings": chat(stop=[str(k) for k in range(17)]),
    "stop 1025 characters": chat(stop="x" * 1025),
    "stop 20,000 characters in a list": chat(stop=["x" * 20_000]),
    "stop empty": chat(stop=""),
    "stop number": chat(stop=5),
    "stop list of lists": chat(stop=[["a"]]),
    "stop on completions": completion(stop=[None]),
}
for name, body in STOPS.items():
    CASES[name] = Case(COMPLETIONS if "prompt" in body else CHAT, body, param="stop")

# ---- invalid Unicode wherever text enters --------------------------------------------------------------
TEXT_AT = {
    "user content": (CHAT, chat(messages=[{"role": "user", "content": f"a{BAD}b"}]), "messages.0.content"),
    "system content": (CHAT, chat(messages=[{"role": "system", "content": BAD}, USER]), "messages.0.content"),
    "assistant content": (
        CHAT,
        chat(messages=[USER, {"role": "assistant", "content": BAD}, USER]),
        "messages.1.content",
    ),
    "content block": (
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": BAD}]}]),
        "messages.0",
    ),
    "role": (CHAT, chat(messages=[{"role": BAD, "content": "x"}]), "messages.0.role"),
    "tool description": (
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f", "description": BAD}}]),
        "tools.0.function.description",
    ),
    "tool schema description": (
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"description": BAD}}}]),
        "tools.0.function.parameters",
    ),
    "schema description": (
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"schema": {"description": BAD}}}),
        "response_format",
    ),
    "tool call arguments": (
        CHAT,
        chat(
            messages=[
                USER,
                {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": BAD}}]},
            ]
        ),  # fmt: skip
        "messages.1.tool_calls",
    ),
    "a key": (CHAT, chat(**{f"x{BAD}": 1}), "x"),
    "model name": (CHAT, chat(model=BAD), "model"),
    "stop string": (CHAT, chat(stop=[BAD]), "stop.0"),
    "user field": (CHAT, chat(user=BAD), "user"),
    "completions prompt": (COMPLETIONS, completion(prompt=BAD), "prompt"),
    "completions prompt list": (COMPLETIONS, completion(prompt=["ok", BAD]), "prompt.1"),
    "tokenize prompt": (TOKENIZE, {"prompt": BAD}, "prompt"),
    "tokenize messages": (TOKENIZE, {"messages": [{"role": "user", "content": BAD}]}, "messages.0.content"),
    "low surrogate alone": (CHAT, chat(messages=[{"role": "user", "content": "\udfff"}]), "messages.0"),
    "surrogate pair reversed": (
        CHAT,
        chat(messages=[{"role": "user", "content": "\udc00\ud800"}]),
        "messages.0",
    ),
}
for name, (path, body, param) in TEXT_AT.items():
    raw = json.dumps(body)  # ensure_ascii: the surrogate travels as \\ud800
    CASES[f"surrogate in {name}"] = Case(path, raw, param=param)

# A tool call's arguments are JSON inside a string: its escapes decode to lone surrogates only there.
ARGUMENTS = {
    "a value": '{"a": "\\ud800"}',
    "a key": '{"\\ud800": 1}',
    "a nested value": '{"a": {"b": ["x", "\\udc00"]}}',
    "a reversed pair": '{"a": "\\udc00\\ud800"}',
}
for name, arguments in ARGUMENTS.items():
    call = {**CALL, "function": {"name": "f", "arguments": arguments}}
    for answered in (False, True):
        result = [{"role": "tool", "tool_call_id": "call_1", "content": "r"}] if answered else []
        body = chat(messages=[USER, {"role": "assistant", "tool_calls": [call]}, *result])
        CASES[f"surrogate in tool call arguments, {name}{', answered' if answered else ''}"] = Case(
            CHAT, body, param="messages[1].tool_calls[0].function.arguments"
        )

# ---- messages, tools, response_format ------------------------------------------------------------------
SHAPES = {
    "messages object": (chat(messages={"role": "user"}), "messages"),
    "messages null": (chat(messages=None), "messages"),
    "message without role": (chat(messages=[{"content": "x"}]), "messages"),
    "role number": (chat(messages=[{"role": 1, "content": "x"}]), "messages"),
    "content number": (chat(messages=[{"role": "user", "content": 1.5}]), "messages"),
    "content null for the user": (chat(messages=[{"role": "user", "content": None}]), "messages"),
    "image block": (
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        "messages",
    ),
    "content part type a list": (chat(messages=[{"role": "user", "content": [{"type": []}]}]), "messages"),
    "content part type an object": (
        chat(messages=[{"role": "user", "content": [{"type": {"a": 1}}]}]),
        "messages",
    ),
    "input_text part without text": (
        chat(messages=[{"role": "user", "content": [{"type": "input_text"}]}]),
        "messages",
    ),
    "refusal part a number": (
        chat(messages=[{"role": "user", "content": [{"type": "refusal", "refusal": 1}]}]),
        "messages",
    ),
    "tool_calls not a list": (chat(messages=[USER, {"role": "assistant", "tool_calls": {}}]), "messages"),
    "tool call without function": (
        chat(messages=[USER, {"role": "assistant", "tool_calls": [{"id": "a", "type": "function"}]}]),
        "messages",
    ),
    "arguments a list": (
        chat(
            messages=[
                USER,
                {
                    "role": "assistant",
                    "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[1]"}}],
                },
            ]
        ),  # fmt: skip
        "messages",
    ),
    "tool name with a quote": (chat(tools=[{"type": "function", "function": {"name": 'a"b'}}]), "tools"),
    "tool name empty": (chat(tools=[{"type": "function", "function": {"name": ""}}]), "tools"),
    "duplicate tool names": (chat(tools=[FN, FN]), "tools"),
    "tool type not function": (chat(tools=[{"type": "code", "function": FN["function"]}]), "tools"),
    "tools malformed with tool_choice none": (
        chat(tools=[{"type": "function"}], tool_choice="none"),
        "tools",
    ),
    "tools a string with tool_choice none": (chat(tools="f", tool_choice="none"), "tools"),
    "tool_choice unknown string": (chat(tools=[FN], tool_choice="always"), "tool_choice"),
    "tool_choice without a function": (chat(tools=[FN], tool_choice={"type": "function"}), "tool_choice"),
    "tool_choice named unknown": (
        chat(tools=[FN], tool_choice={"type": "function", "function": {"name": "g"}}),
        "tool_choice",
    ),
    "response_format unknown type": (chat(response_format={"type": "xml"}), "response_format"),
    "response_format string": (chat(response_format="json"), "response_format"),
    "json_schema schema not an object": (
        chat(response_format={"type": "json_schema", "json_schema": {"schema": [1]}}),
        "response_format",
    ),
    "json_schema invalid type": (
        chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}),
        "response_format",
    ),
    "json_object with a schema": (
        chat(response_format={"type": "json_object", "json_schema": {"schema": {}}}),
        "response_format",
    ),
}
for name, (body, param) in SHAPES.items():
    CASES[name] = Case(CHAT, body, param=param)

# ---- sizes ---------------------------------------------------------------------------------------------
SIZES = {
    "prompt of 100,000 tokens": (COMPLETIONS, completion(prompt=[5] * 100_000), 400, "prompt"),
    "prompt over the context in words": (
        COMPLETIONS,
        completion(prompt="word " * (MAX_MODEL_LEN * 2)),
        400,
        "prompt",
    ),
    "one 3 MB word": (COMPLETIONS, completion(prompt="a" * 3_000_000), 400, "prompt"),
    "chat of 3 MB": (CHAT, chat(messages=[{"role": "user", "content": "b" * 3_000_000}]), 400, "messages"),
    "10,000 messages": (CHAT, chat(messages=[USER] * 10_000), 400, "messages"),
    "65 prompts": (COMPLETIONS, completion(prompt=["a"] * 65), 400, "prompt"),
    "33 prompts with n=2": (COMPLETIONS, completion(prompt=["a"] * 33, n=2), 400, "prompt"),
    "max_tokens over the context": (CHAT, chat(max_tokens=MAX_MODEL_LEN), 400, "max_tokens"),
    "body over the limit": (CHAT, chat(user="x" * 5 * 2**20), 413, None),
    "20 MB body": (CHAT, chat(messages=[{"role": "user", "content": "c" * 20 * 2**20}]), 413, None),
    "nesting 100,000 deep": (CHAT, "[" * 100_000, 400, None),
    "nesting in a field": (CHAT, json.dumps(chat(user=[])).replace("[]", "[" * 5000 + "]" * 5000), 400, None),
}
for name, (path, body, status, param) in SIZES.items():
    CASES[name] = Case(path, body, status, param)

# ---- bodies and headers --------------------------------------------------------------------------------
CASES["text/plain body"] = Case(CHAT, chat(), 415, headers={"Content-Type": "text/plain"})
CASES["form body"] = Case(CHAT, chat(), 415, headers={"Content-Type": "application/x-www-form-urlencoded"})
CASES["multipart body"] = Case(
    COMPLETIONS, completion(), 415, headers={"Content-Type": "multipart/form-data"}
)
CASES["body in latin-1"] = Case(
    CHAT, '{"messages": [{"role": "user", "content": "caf\xe9"}]}'.encode("latin-1")
)
CASES["body with a BOM"] = Case(CHAT, "\ufeff" + json.dumps(chat()))
CASES["body a JSON string"] = Case(CHAT, '"hello"')
CASES["body null"] = Case(CHAT, "null")
CASES["body trailing garbage"] = Case(CHAT, json.dumps(chat()) + "x")
CASES["duplicate keys"] = Case(CHAT, '{"messages": [], "messages": []}')
CASES["no API key"] = Case(CHAT, chat(), 401, headers={"Authorization": ""})
CASES["wrong API key"] = Case(CHAT, chat(), 401, headers={"Authorization": "Bearer sk-wrong"})
CASES["API key without Bearer"] = Case(CHAT, chat(), 401, headers={"Authorization": API_KEY})


def _send(server: Served, case: Case) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json", **case.headers}
    headers = {k: v for k, v in headers.items() if v is not None}
    with httpx.Client(base_url=server.url, timeout=120) as http:
        return http.post(case.path, content=case.raw(), headers=headers)


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> None:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] in ("invalid_request_error", "authentication_error", "NotFoundError")
    if param is not None:
        assert (error["param"] or "").startswith(param), error


def five_hundreds(server: Served) -> float:
    return sum(
        v
        for k, v in server.metrics().items()
        if k.startswith("deepseek:http_requests_total") and 'status="5' in k
    )


@pytest.fixture(scope="module")
def watched(server: Served):
    """The server, checked after the module: no 5xx counted, no traceback logged, healthy."""
    before, log_start = five_hundreds(server), server.log.stat().st_size
    yield server
    assert five_hundreds(server) == before
    with server.log.open() as log:
        log.seek(log_start)
        assert "Traceback" not in log.read()
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_there_are_at_least_150_cases():
    assert len(CASES) >= 150, len(CASES)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_hostile_request_gets_its_4xx(watched: Served, case: Case):
    assert_error(_send(watched, case), case.status, case.param)


CHUNKED_BIG = 5 * 2**20


def test_a_chunked_body_over_the_limit_is_413_before_it_is_read_whole(watched: Served):
    def chunks():
        for _ in range(CHUNKED_BIG // 65536 + 1):
            yield b" " * 65536

    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    try:
        r = httpx.post(f"{watched.url}{CHAT}", content=chunks(), headers=headers, timeout=60)
    except httpx.TransportError:  # the server may close the connection once it has answered
        return
    assert_error(r, 413)


ROUTES = [
    ("GET", "/v1/nothing", 404),
    ("GET", CHAT, 405),
    ("PUT", COMPLETIONS, 405),
    ("POST", "/v1/models", 405),
    ("POST", "/health", 405),
    ("DELETE", "/metrics", 405),
    ("GET", "/../../etc/passwd", 404),
    ("GET", "/v1/" + "a" * 8000, 404),
    ("GET", "/v1/chat/completions%00", 404),
]


@pytest.mark.parametrize(("method", "path", "status"), ROUTES, ids=[f"{m} {p[:30]}" for m, p, _ in ROUTES])
def test_routes_that_do_not_exist_get_error_objects(watched: Served, method: str, path: str, status: int):
    r = httpx.request(
        method, f"{watched.url}{path}", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
    )
    assert_error(r, status)


def _raw_http(server: Served, data: bytes, wait: float = 0.2) -> bytes:
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(data)
        time.sleep(wait)
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        try:
            while chunk := sock.recv(65536):
                reply += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    return reply


def _request_head(path: str, extra: str) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\n{extra}\r\n"
    ).encode()


TRANSPORT = {
    "body shorter than its Content-Length": _request_head(CHAT, "Content-Length: 1000\r\n") + b'{"messages"',
    "bad chunk size": _request_head(CHAT, "Transfer-Encoding: chunked\r\n") + b"zz\r\nabc\r\n0\r\n\r\n",
    "chunked body cut off": _request_head(CHAT, "Transfer-Encoding: chunked\r\n") + b"100\r\n{}",
    "garbage request line": b"HELLO\r\n\r\n",
    "header without a colon": b"POST /v1/completions HTTP/1.1\r\nHost x\r\n\r\n",
    "headers cut off": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Len",
    "both length and chunked": _request_head(
        COMPLETIONS, "Content-Length: 3\r\nTransfer-Encoding: chunked\r\n"
    )
    + b"0\r\n\r\n",
}


@pytest.mark.parametrize("data", TRANSPORT.values(), ids=TRANSPORT.keys())
def test_transport_faults_are_never_5xx(watched: Served, data: bytes):
    reply = _raw_http(watched, data)
    if reply:  # uvicorn answers protocol errors itself; a cut-off body gets no answer
        status = int(reply.split(b" ", 2)[1])
        assert 400 <= status < 500, reply[:300]


def test_a_client_gone_while_sending_counts_as_499(watched: Served):
    before = watched.metric("deepseek:http_requests_total", endpoint=CHAT, status="499")
    _raw_http(watched, _request_head(CHAT, "Content-Length: 5000\r\n") + b'{"messages": [')
    deadline = time.monotonic() + 10
    while watched.metric("deepseek:http_requests_total", endpoint=CHAT, status="499") == before:
        assert time.monotonic() < deadline, "the disconnect was not counted"
        time.sleep(0.05)


ODD_BUT_VALID = {
    "NUL in content": chat(messages=[{"role": "user", "content": "a\u0000b"}]),
    "NUL in a stop string": chat(stop=["\u0000"]),
    "emoji and a 4-byte character": chat(messages=[{"role": "user", "content": "\U0001f600 \U00020000"}]),
    "right-to-left and zero-width": chat(messages=[{"role": "user", "content": "\u202eabc\u200b\ufeff"}]),
    "combining marks": chat(messages=[{"role": "user", "content": "e\u0301" * 50}]),
    "seed at the top of the range": chat(seed=2**64 - 1),
    "seed at the bottom of the range": chat(seed=-(2**63)),
    "top_p tiny": chat(top_p=1e-37),
    "repetition_penalty tiny": chat(repetition_penalty=1e-37, temperature=0.7),
    "temperature tiny": chat(temperature=1e-30),
    "logit_bias on every listed token": chat(logit_bias={str(t): -100 for t in range(1024)}),
    "stop of the maximum length": chat(stop=["y" * 1024] * 16),
    "no Content-Type header": completion(),
    "model an empty string": chat(model=""),
    # JSON has one kind of number: a whole float is an integer (vLLM takes it too).
    "integers written as floats": chat(max_tokens=2.0, n=2.0, seed=1e3, top_k=-1.0, min_tokens=0.0),
    "token ids written as floats": completion(prompt=[5.0, 6.0], logprobs=1.0),
    # Clients send unset optional fields as null: each takes its default.
    "null for every defaulted chat field": chat(
        **dict.fromkeys(
            [
                "n",
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
                "ignore_eos",
                "min_tokens",
                "skip_special_tokens",
                "stream",
                "logprobs",
                "parallel_tool_calls",
                "add_generation_prompt",
            ]
        )
    ),  # fmt: skip
    "null for every defaulted completion field": completion(n=None, echo=None, stream=None, temperature=None),
    "OpenAI's participant names": chat(
        messages=[{"role": "system", "content": "S", "name": "rules"}, {**USER, "name": "ann"}]
    ),
    "a reply sent back as the server gave it": chat(
        messages=[
            USER,
            {
                "role": "assistant",
                "content": "Hello",
                "reasoning": "r",
                "reasoning_content": "r",
                "refusal": None,
            },
            USER,
        ],
        chat_template_kwargs={"thinking": True, "drop_thinking": None},
    ),
}


@pytest.mark.parametrize("body", ODD_BUT_VALID.values(), ids=ODD_BUT_VALID.keys())
def test_odd_but_valid_requests_complete(watched: Served, body: dict):
    headers = {"Content-Type": None} if body is ODD_BUT_VALID["no Content-Type header"] else {}
    path = COMPLETIONS if "prompt" in body else CHAT
    r = _send(watched, Case(path, body, headers=headers))
    assert r.status_code == 200, r.text[:500]
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


NAMED = {
    "top_logprobs over 20": (CHAT, chat(logprobs=True, top_logprobs=50), ["50", "20"]),
    "max_tokens not whole": (CHAT, chat(max_tokens=5.5), ["5.5"]),
    "seed over 2**64 - 1": (CHAT, chat(seed=2**64), [str(2**64), str(2**64 - 1)]),
    "n over 16": (CHAT, chat(n=17), ["17", "16"]),
    "temperature over 2": (CHAT, chat(temperature=2.5), ["2.5", "2"]),
    "stop strings over 16": (CHAT, chat(stop=["s"] * 20), ["20", "16"]),
    "unknown model": (CHAT, chat(model="gpt-4"), ["gpt-4", MODEL]),
    "prompt + max_tokens over the context": (
        COMPLETIONS,
        completion(prompt=[5] * 1000, max_tokens=100),
        ["1000", "100", str(MAX_MODEL_LEN)],
    ),
}


@pytest.mark.parametrize(("path", "body", "named"), NAMED.values(), ids=NAMED.keys())
def test_an_error_names_the_value_and_the_limit(watched: Served, path: str, body: dict, named: list[str]):
    message = _send(watched, Case(path, body)).json()["error"]["message"]
    assert all(text in message for text in named), message


def test_an_unknown_model_is_vllms_not_found_error(watched: Served):
    r = _send(watched, Case(CHAT, chat(model="gpt-4")))
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
