"""Parsing V4.1 completions (model-spec §11.2): the V4.1 DSML tags, a block inside the reasoning is malformed,
and streaming splits reasoning / content / tool calls exactly as the whole-text parse at every chunking."""

import json
import random
from itertools import pairwise

import pytest

from model.chat_parse import CompletionParseError, StreamParser, ToolCall, parse_completion
from model.chat_profile import V41

START, END = "\n\n<｜DSML｜ calls>\n", "\n</｜DSML｜ calls>"


def invoke(name, *params):
    body = "\n".join(
        f'<｜DSML｜ parameter name="{k}" string="{t}">{v}</｜DSML｜ parameter>' for k, t, v in params
    )
    return f'<｜DSML｜ invoke name="{name}">\n{body}\n</｜DSML｜ invoke>'


def block(*invokes):
    return START + "\n".join(invokes) + END


WEATHER = invoke("get_weather", ("city", "true", "Paris\n</think>"), ("days", "false", '[1, {"a": null}]'))
NOW = invoke("now")
V4_BLOCK = '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="now">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'


def parse(text, thinking):
    return parse_completion(text, thinking=thinking, profile=V41)


def test_reasoning_content_and_tool_calls():
    parsed = parse(f"let me see</think>Checking.{block(WEATHER, NOW)}", thinking=True)
    assert (parsed.reasoning_content, parsed.content) == ("let me see", "Checking.")
    weather = {"city": "Paris\n</think>", "days": [1, {"a": None}]}
    assert parsed.tool_calls == [
        ToolCall("call_0", "get_weather", json.dumps(weather)),
        ToolCall("call_1", "now", "{}"),
    ]
    # V4's tag names are not V4.1 tool calls: plain content.
    plain = parse(f"Hi{V4_BLOCK}", thinking=False)
    assert (plain.content, plain.tool_calls) == (f"Hi{V4_BLOCK}", [])
    cut = parse("still thinking\n\n<｜DSML｜ cal", thinking=True)  # a length cut, not a block
    assert (cut.reasoning_content, cut.content) == ("still thinking\n\n<｜DSML｜ cal", "")


@pytest.mark.parametrize(
    "text",
    [
        f"thinking{block(NOW)}",  # a block inside the reasoning
        f"thinking{block(NOW)}</think>answer",
        f"r</think>{block(invoke('f', ('a', 'true', '1'), ('a', 'true', '2')))}",  # duplicate parameter
        f"r</think>{block(invoke('f', ('a', 'false', 'tru')))}",
        f"r</think>{block(invoke('f', ('a', 'false', 'NaN')))}",
        f"r</think>{block()}",
        f"r</think>{block(NOW)}trailing",
        f"r</think>{block(NOW).removesuffix(END)}",  # unterminated
        f"r</think>{block(NOW).replace('｜ invoke', '｜invoke')}",  # V4 tag inside a V4.1 block
    ],
)
def test_malformed_completions_are_rejected(text):
    with pytest.raises(CompletionParseError):
        parse(text, thinking=True)


SAMPLES = [
    ("plain answer", False),
    ("short reasoning</think>Answer with </think> inside", True),
    (f"r</think>Calling.{block(WEATHER)}", True),
    (f"Two calls:{block(WEATHER, NOW)}", False),
    (f"hmm</th</think>{block(NOW)}", True),
    ("near misses \n\n<｜DSML｜ call and \n\n<｜DSML｜ calls", True),  # rejected: the prefix in reasoning
    (f"text\n\n<｜DSML｜tool_calls{V4_BLOCK}", False),
    (f"reasoning{block(NOW)}</think>x", True),  # rejected
    (f"r</think>{block(NOW)}junk", True),  # rejected
    (f"r</think>{block(NOW)[:-4]}", True),  # rejected: unterminated
    ("\n\n\n<｜DSML｜  calls>\n", False),
    (f"</think>{block(invoke('f', ('x', 'true', '')))}", True),
]


def _outcome(run):
    try:
        return run()
    except CompletionParseError:
        return "rejected"


def _whole(text, thinking):
    parsed = parse(text, thinking)
    return parsed.reasoning_content or "", parsed.content, parsed.tool_calls


def _streamed(text, cuts, thinking):
    parser = StreamParser(thinking=thinking, profile=V41)
    bounds = [0, *sorted(cuts), len(text)]
    deltas = [parser.feed(text[a:b]) for a, b in pairwise(bounds)] + [parser.finish()]
    return (
        "".join(d.reasoning_content for d in deltas),
        "".join(d.content for d in deltas),
        [c for d in deltas for c in d.tool_calls],
    )


@pytest.mark.parametrize(("text", "thinking"), SAMPLES)
def test_streaming_matches_the_whole_parse_at_every_chunking(text, thinking):
    whole = _outcome(lambda: _whole(text, thinking))
    rng = random.Random(text)
    chunkings = [[k] for k in range(len(text) + 1)]  # every single split point
    chunkings.append(list(range(len(text))))  # character by character
    chunkings += [rng.sample(range(len(text)), min(len(text), rng.randint(2, 12))) for _ in range(50)]
    for cuts in chunkings:
        assert _outcome(lambda cuts=cuts: _streamed(text, cuts, thinking)) == whole, cuts
