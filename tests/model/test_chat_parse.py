"""Completion parsing (model-spec §11): reasoning split, strict DSML tool calls, render -> parse round trip,
and streaming that agrees with the whole-text parse for every split of the text."""

import json
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model.chat import RESERVED_FRAGMENTS, encode_messages
from model.chat_parse import CompletionParseError, StreamDelta, StreamParser, ToolCall, parse_completion
from model.chat_profile import PROFILES

ASSISTANT, EOS = "<｜Assistant｜>", "<｜end▁of▁sentence｜>"
BLOCK_START, BLOCK_END = "\n\n<｜DSML｜tool_calls>\n", "\n</｜DSML｜tool_calls>"
INVOKE_END, PARAM_END = "</｜DSML｜invoke>", "</｜DSML｜parameter>"


def invoke(name, *params):
    body = "\n".join(f'<｜DSML｜parameter name="{k}" string="{t}">{v}{PARAM_END}' for k, t, v in params)
    return f'<｜DSML｜invoke name="{name}">\n{body}\n{INVOKE_END}'


def block(*invokes):
    return BLOCK_START + "\n".join(invokes) + BLOCK_END


WEATHER = invoke("get_weather", ("city", "true", 'Paris "FR"\nnow'), ("days", "false", '[1, {"a": null}]'))


def test_reasoning_and_content():
    plain = parse_completion("Hi </think> there", thinking=False)
    assert (plain.reasoning_content, plain.content, plain.tool_calls) == (None, "Hi </think> there", [])
    split = parse_completion("let me see</think>Answer</think>", thinking=True)
    assert (split.reasoning_content, split.content) == ("let me see", "Answer</think>")
    cut = parse_completion("still thinking\n\n<｜DSML｜tool_calls", thinking=True)  # a length cut
    assert (cut.reasoning_content, cut.content) == ("still thinking\n\n<｜DSML｜tool_calls", "")


def test_tool_calls():
    parsed = parse_completion(f"r</think>Checking.{block(WEATHER, invoke('now'))}", thinking=True)
    assert (parsed.reasoning_content, parsed.content) == ("r", "Checking.")
    assert parsed.tool_calls == [
        ToolCall("call_0", "get_weather", json.dumps({"city": 'Paris "FR"\nnow', "days": [1, {"a": None}]})),
        ToolCall("call_1", "now", "{}"),
    ]
    ids = parse_completion(block(WEATHER, WEATHER), thinking=False, id_factory=lambda i: f"req7-{i}")
    assert [c.id for c in ids.tool_calls] == ["req7-0", "req7-1"]
    assert ids.tool_calls[0].to_openai() == {
        "id": "req7-0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": ids.tool_calls[0].arguments},
    }
    with pytest.raises(ValueError, match="id factory"):
        parse_completion(block(WEATHER, WEATHER), thinking=False, id_factory=lambda i: "same")


@pytest.mark.parametrize(
    "text",
    [
        block(invoke("f", ("a", "true", "1"), ("a", "true", "2"))),  # duplicate parameter
        block(invoke("f", ("a", "false", "NaN"))),
        block(invoke("f", ("a", "false", "1e999"))),
        block(invoke("f", ("a", "false", '{"b": 1, "b": 2}'))),
        block(invoke("f", ("a", "false", "tru"))),
        block(invoke("f", ("a", "maybe", "1"))),
        block(invoke('f"g')),
        block(invoke("f")).replace(">\n<｜DSML｜invoke", "><｜DSML｜invoke"),
        block(invoke("f", ("a", "true", "1"), ("b", "true", "2"))).replace(f"{PARAM_END}\n", PARAM_END),
        block(),  # no call at all
        block(invoke("f")) + "trailing",
        block(invoke("f")) + EOS,
        block(invoke("f")).removesuffix(BLOCK_END),  # unterminated
        block(invoke("f"))[:-3],
        "text\n\n<｜DSML｜tool_callsX",
        block(invoke("f")).replace(INVOKE_END, "</｜DSML｜invoke >"),
    ],
)
def test_malformed_tool_calls_are_rejected(text):
    with pytest.raises(CompletionParseError):
        parse_completion(text, thinking=False)


ARG_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12).filter(
    lambda s: not any(f in s for f in RESERVED_FRAGMENTS)
)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(10**20), 10**20)
    | st.floats(allow_nan=False, allow_infinity=False)
)
JSON_VALUES = st.recursive(
    SCALARS | ARG_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(ARG_TEXT, inner, max_size=3),
    max_leaves=8,
)
ARGUMENTS = st.dictionaries(st.from_regex(r'[^"<>\r\n｜]{1,8}', fullmatch=True), JSON_VALUES, max_size=4)
TOOL_NAMES = st.from_regex(r"[A-Za-z_][\w.-]{0,10}", fullmatch=True)


@pytest.mark.parametrize("profile", PROFILES.values(), ids=PROFILES)
@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(TOOL_NAMES, ARGUMENTS), min_size=1, max_size=3))
def test_render_parse_round_trip(profile, calls):
    """Encode an assistant turn with tool calls, parse its text back: the same calls, the same prompt."""
    openai_calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(calls)
    ]
    convo = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "ok", "tool_calls": openai_calls},
    ]
    prompt = encode_messages(convo, profile=profile)
    completion = prompt.split(ASSISTANT, 1)[1].removeprefix("</think>").removesuffix(EOS)
    assert completion.startswith(f"ok{profile.tool_calls_prefix}>")
    parsed = parse_completion(completion, thinking=False, profile=profile)
    assert parsed.content == "ok"
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    convo[1]["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
    assert encode_messages(convo, profile=profile) == prompt


def test_streaming_holds_back_only_possible_markers():
    parser = StreamParser(thinking=True)
    assert parser.feed("abc</th").reasoning_content == "abc"
    delta = parser.feed("ink>Hello\n")
    assert (delta.reasoning_content, delta.content) == ("", "Hello")
    assert parser.feed("\n<｜DS").content == ""
    assert parser.feed("x").content == "\n\n<｜DSx"  # not the prefix after all
    assert parser.feed("\n").content == "" and parser.finish().content == "\n"
    # Each call is handed out as soon as its invoke closes, before the block ends.
    parser = StreamParser(thinking=False)
    assert parser.feed(f"Hi{BLOCK_START}{WEATHER}").tool_calls[0].name == "get_weather"
    assert parser.feed(BLOCK_END) == StreamDelta() and parser.finish() == StreamDelta()


# Near misses of every marker make the plain text; the tool-call syntax comes on top for the soup.
PLAIN = ["a", " ", "\n", "\n\n", "<", ">", "/", "｜", "</think>", "</th", "think>", "<think>"]
PLAIN += ["\n\n<｜DSML｜", "\n\n<｜DSML｜tool_call"]
SYNTAX = ["\n\n<｜DSML｜tool_calls", BLOCK_START, BLOCK_END, WEATHER, invoke("now"), '{"x": 1}']
SYNTAX += [INVOKE_END, EOS]
TEXTS = st.one_of(
    st.lists(st.sampled_from(PLAIN + SYNTAX), max_size=12).map("".join),
    st.builds(
        lambda r, c, calls: f"{r}</think>{c}" + (block(*calls) if calls else ""),
        st.lists(st.sampled_from(PLAIN), max_size=5).map("".join),
        st.lists(st.sampled_from(PLAIN), max_size=5).map("".join),
        st.lists(st.sampled_from([WEATHER, invoke("now")]), max_size=3),
    ),
)


def _outcome(run):
    try:
        return run()
    except CompletionParseError:
        return "rejected"


def _stream(text, cuts, thinking):
    parser = StreamParser(thinking=thinking)
    reasoning, content, calls = "", "", []
    bounds = [0, *sorted(cuts), len(text)]
    deltas = [parser.feed(text[a:b]) for a, b in pairwise(bounds)] + [parser.finish()]
    for d in deltas:
        reasoning, content, calls = reasoning + d.reasoning_content, content + d.content, calls + d.tool_calls
    return reasoning, content, calls


@settings(max_examples=400, deadline=None)
@given(TEXTS, st.booleans(), st.data())
def test_streaming_matches_whole_parse_for_any_split(text, thinking, data):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    whole = _outcome(lambda: parse_completion(text, thinking=thinking))
    if whole != "rejected":
        whole = (whole.reasoning_content or "", whole.content, whole.tool_calls)
    assert _outcome(lambda: _stream(text, cuts, thinking)) == whole
    # Character by character is the hardest split.
    assert _outcome(lambda: _stream(text, range(len(text)), thinking)) == whole
