"""Chat encoding (model-spec §11): exact layouts, tool results, reasoning effort, every validation rule."""

import json

import pytest

from model.chat import RESERVED_FRAGMENTS, ChatFormatError, encode_messages, known_fields

# Spelled out rather than imported, so a typo in the module's constants cannot pass unnoticed.
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT, REMINDER = "<｜User｜>", "<｜Assistant｜>", "<｜latest_reminder｜>"
THINK, END_THINK = "<think>", "</think>"
HIGH = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the "
    "root cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
    "adversarial scenarios.\nExplicitly write out your entire deliberation process, documenting every "
    "intermediate step, considered alternative, and rejected hypothesis to ensure absolutely no assumption "
    "is left unchecked.\n\n"
)
MAX = (
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
    "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
    "resolve the underlying cause rather than any surface symptom.\nDo not stop reasoning until you have "
    "independently verified the solution from multiple angles and are certain that no assumption remains "
    "unchecked and no error remains undiscovered.\n\n"
)
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
TOOLS_SECTION = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{"name": "get_weather", "parameters": {"type": "object"}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""  # noqa: E501  (byte-exact protocol text)
RESPONSE_FORMAT = (
    '## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{"type": "object"}'
)


def user(text):
    return {"role": "user", "content": text}


def assistant(content, reasoning=None, calls=None):
    msg = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    return msg | ({"tool_calls": calls} if calls else {})


def call(call_id, name="f", **arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def tool(call_id, text):
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def system(text):
    return {"role": "system", "content": text}


def task(text, name):
    return user(text) | {"task": name}


T = {"thinking": True}
CHAT, GEN = ASSISTANT + END_THINK, ASSISTANT + THINK  # generation headers: chat mode, reasoning kept
S, U = system("S"), user("U")
HISTORY = [S, user("q1"), assistant("a1", "r1"), user("q2")]
WEATHER_CALLS = [call("a", "get_weather", city="Paris", days=[1, 2]), call("b", "now")]
BLOCK = (
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">[1, 2]</｜DSML｜parameter>\n'
    '</｜DSML｜invoke>\n<｜DSML｜invoke name="now">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
)
RESULTS = "<tool_result>A</tool_result>\n\n<tool_result>B</tool_result>"
TOOL_TURN = [user("q"), assistant("Let me check.", calls=WEATHER_CALLS), tool("b", "B"), tool("a", "A")]


TURNS = f"{USER}q1{ASSISTANT}{END_THINK}a1{EOS}{USER}q2{ASSISTANT}"
KEPT = f"{USER}q1{ASSISTANT}{THINK}r1{END_THINK}a1{EOS}{USER}q2{ASSISTANT}{THINK}"  # no reasoning dropped


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, f"S{TURNS}{END_THINK}"),
        ({"thinking": True}, f"S{TURNS}{THINK}"),
        ({"thinking": True, "drop_thinking": False}, f"S{KEPT}"),
        ({"add_generation_prompt": False}, f"S{TURNS.removesuffix(ASSISTANT)}"),
        ({"thinking": True, "reasoning_effort": "high"}, f"{HIGH}S{TURNS}{THINK}"),
        ({"thinking": True, "reasoning_effort": "max"}, f"{MAX}S{TURNS}{THINK}"),
        ({"thinking": True, "reasoning_effort": "low"}, f"S{TURNS}{THINK}"),
        ({"reasoning_effort": "max"}, f"S{TURNS}{END_THINK}"),  # effort only applies to thinking mode
        ({"response_format": {"type": "object"}}, f"S\n\n{RESPONSE_FORMAT}{TURNS}{END_THINK}"),
        ({"tools": [TOOL], "thinking": True}, f"S\n\n{TOOLS_SECTION}{KEPT}"),  # tools disable dropping
        (
            {"tools": [TOOL], "response_format": {"type": "object"}},
            f"S\n\n{TOOLS_SECTION}\n\n{RESPONSE_FORMAT}{TURNS}{END_THINK}",
        ),
        ({"tools": []}, f"S{TURNS}{END_THINK}"),
    ],
)
def test_layout(kwargs, expected):
    assert encode_messages(HISTORY, **kwargs) == BOS + expected


def test_exact_small_prompts():
    assert encode_messages([user("Hi")]) == f"{BOS}{USER}Hi{ASSISTANT}{END_THINK}"
    assert encode_messages([user("Hi")], thinking=True) == f"{BOS}{USER}Hi{ASSISTANT}{THINK}"
    # The reply to the last user turn keeps its reasoning even with dropping on.
    convo = [user("Hi"), assistant("Hello", "greet")]
    assert (
        encode_messages(convo, thinking=True) == f"{BOS}{USER}Hi{ASSISTANT}{THINK}greet{END_THINK}Hello{EOS}"
    )
    assert encode_messages(convo) == f"{BOS}{USER}Hi{ASSISTANT}{END_THINK}Hello{EOS}"
    # Without a system message the sections go to an empty one put first.
    assert (
        encode_messages([user("Hi")], tools=[TOOL])
        == f"{BOS}\n\n{TOOLS_SECTION}{USER}Hi{ASSISTANT}{END_THINK}"
    )
    # Blocks and consecutive user messages merge into one turn, joined by blank lines.
    blocks = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert encode_messages([blocks, user("c")]) == f"{BOS}{USER}a\n\nb\n\nc{ASSISTANT}{END_THINK}"


def test_a_reply_sent_back_as_given_renders_as_the_plain_message():
    """A client returns the assistant message as the server gave it (`reasoning` beside
    `reasoning_content`) and OpenAI's participant `name`s: the prompt is that of the plain messages."""
    plain = [user("Hi"), assistant("Hello", reasoning="greet"), user("Bye")]
    returned = [
        user("Hi") | {"name": "ann"},
        {"role": "assistant", "content": "Hello", "reasoning": "greet", "reasoning_content": "greet"},
        user("Bye") | {"name": "ann"},
    ]
    only_reasoning = [
        user("Hi"),
        {"role": "assistant", "content": "Hello", "reasoning": "greet"},
        user("Bye"),
    ]
    for kwargs in ({}, {"thinking": True, "drop_thinking": False}):
        assert encode_messages(returned, **kwargs) == encode_messages(plain, **kwargs)
        assert encode_messages(only_reasoning, **kwargs) == encode_messages(plain, **kwargs)


def test_known_fields_drops_what_the_encoding_has_no_place_for_and_names_it():
    """The lenient pre-pass (the server's, as vLLM): extras go, text parts of every kind are text parts."""
    sent = [
        user("Hi") | {"cache_control": {"type": "ephemeral"}, "refusal": None},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "No"}], "annotations": [],
         "tool_calls": [call("a") | {"index": 0}]},
        tool("a", [{"type": "input_text", "text": "r", "cache_control": {}}]),
        {"role": "user", "content": [{"type": "output_text", "text": "Bye"}]},
    ]  # fmt: skip
    plain = [user("Hi"), assistant("No", calls=[call("a")]), tool("a", "r"), user("Bye")]
    kept, ignored = known_fields(sent)
    assert encode_messages(kept) == encode_messages(plain)
    assert ignored == [
        "messages[].annotations",
        "messages[].cache_control",
        "messages[].content[].cache_control",
        "messages[].tool_calls[].index",
    ]
    odd = [
        "hi",
        {"role": "robot"},
        user([{"type": "input_text"}]),
        user([{"type": []}]),
        user([{"type": {}}]),
    ]
    assert known_fields(odd) == (odd, [])  # shapes it does not know stay, for encode_messages to refuse


def test_developer_and_reminder():
    dev = {"role": "developer", "content": "D"}
    reminder = {"role": "latest_reminder", "content": "R"}
    assert encode_messages([dev]) == f"{BOS}{USER}D{ASSISTANT}{END_THINK}"
    convo = [dev, assistant("a"), user("q")]
    assert encode_messages(convo) == f"{BOS}{USER}D{ASSISTANT}{END_THINK}a{EOS}{USER}q{ASSISTANT}{END_THINK}"
    # Thinking with dropping leaves out developer turns before the last user turn (official behaviour).
    assert encode_messages(convo, thinking=True) == f"{BOS}a{EOS}{USER}q{ASSISTANT}{THINK}"
    assert encode_messages([reminder, user("q")]) == f"{BOS}{REMINDER}R{USER}q{ASSISTANT}{END_THINK}"
    # A reminder after the user turn follows the assistant opening, and nothing is appended after it.
    assert encode_messages([user("q"), reminder]) == f"{BOS}{USER}q{ASSISTANT}{END_THINK}{REMINDER}R"


def test_tool_call_block_and_results_order():
    text = encode_messages([*TOOL_TURN, user("more")])
    assert text == f"{BOS}{USER}q{ASSISTANT}{END_THINK}Let me check.{BLOCK}{EOS}{USER}{RESULTS}\n\nmore{CHAT}"
    # User text between results keeps its place; the results alone take the order of the calls.
    convo = [user("q"), assistant("", calls=WEATHER_CALLS), tool("b", "B"), user("note"), tool("a", "A")]
    assert encode_messages(convo).endswith(
        f"<tool_result>A</tool_result>\n\nnote\n\n<tool_result>B</tool_result>{ASSISTANT}</think>"
    )
    # One call: the result may omit its id.
    convo = [user("q"), assistant("", calls=[call("x")]), {"role": "tool", "content": "X"}]
    assert encode_messages(convo).endswith(f"{USER}<tool_result>X</tool_result>{ASSISTANT}{END_THINK}")


def test_reserved_fragments_cover_every_protocol_string():
    expected = {BOS, EOS, "<｜▁pad▁｜>", USER, ASSISTANT, REMINDER, THINK, END_THINK, "｜DSML｜"}
    expected |= {"<tool_result>", "</tool_result>", "<｜action｜>", "<｜query｜>", "<｜authority｜>"}
    expected |= {"<｜domain｜>", "<｜title｜>", "<｜read_url｜>"}
    assert expected <= set(RESERVED_FRAGMENTS)
    for fragment in RESERVED_FRAGMENTS:
        with pytest.raises(ChatFormatError, match=r"^messages\[0\]\.content: contains the reserved"):
            encode_messages([user(f"x{fragment}y")])


def req(*messages, **kwargs):
    return {"messages": list(messages), **kwargs}


def bad_call(fn=None, name=None, **fields):
    """A request whose only tool call has `fields` replaced, or function name/arguments `name`/`fn`."""
    c = call("a") | fields
    if fn is not None or name is not None:
        c["function"] = {"name": "f" if name is None else name, "arguments": "{}" if fn is None else fn}
    return req(assistant("", calls=[c]))


def bad_tool(**function):
    return req(user("q"), tools=[{"type": "function", "function": {"name": "f", **function}}])


CALL, ARGS = "messages[0].tool_calls[0]", "messages[0].tool_calls[0].function.arguments"
CALLS = [user("q"), assistant("", calls=[call("a"), call("b")])]
NO_ID = {"role": "tool", "content": "x"}
BAD_REQUESTS = [
    ({"messages": "hi"}, "messages"),
    (req(), "messages"),
    (req("hi"), "messages[0]"),
    (req({"content": "x"}), "messages[0].role"),
    (req({"role": "function", "content": "x"}), "messages[0].role"),
    (req(user("x") | {"name": 5}), "messages[0].name"),
    (req(assistant("", reasoning="a") | {"reasoning": "b"}), "messages[0].reasoning"),
    (req({"role": "assistant", "content": "", "reasoning": 1}), "messages[0].reasoning"),
    (req(user("x") | {"reasoning_content": "r"}), "messages[0].reasoning_content"),
    (req({"role": "user"}), "messages[0].content"),
    (req(user(3)), "messages[0].content"),
    (req(user([])), "messages[0].content"),
    (req(user(["x"])), "messages[0].content[0]"),
    (req(user([{"type": "image_url", "image_url": "u"}])), "messages[0].content[0]"),
    (req(user([{"type": "text", "text": "x", "cache": 1}])), "messages[0].content[0]"),
    (req(user([{"type": "text", "text": 5}])), "messages[0].content[0].text"),
    (req(user([{"type": "text", "text": "<think>"}])), "messages[0].content[0].text"),
    (req({"role": "developer", "content": ""}), "messages[0].content"),
    (req({"role": "system", "content": "</tool_result>"}), "messages[0].content"),
    (req({"role": "latest_reminder", "content": "<｜User｜>"}), "messages[0].content"),
    (req(assistant("<｜end▁of▁sentence｜>")), "messages[0].content"),
    (req(assistant("", reasoning=1)), "messages[0].reasoning_content"),
    (req(assistant("", reasoning="a</think>b")), "messages[0].reasoning_content"),
    (req({"role": "assistant", "tool_calls": {}}), "messages[0].tool_calls"),
    (req(assistant("", calls=["f"])), CALL),
    (bad_call(index=0), CALL),
    (bad_call(type="code"), f"{CALL}.type"),
    (bad_call(id=7), f"{CALL}.id"),
    (bad_call(id=""), f"{CALL}.id"),
    (req(assistant("", calls=[call("a"), call("a")])), "messages[0].tool_calls[1].id"),
    (bad_call(function={"name": "f"}), f"{CALL}.function"),
    *(
        (bad_call(name=n), f"{CALL}.function.name")
        for n in ['a"b', "a<b", "a>", "a\nb", "a\rb", "", 3, "x｜DSML｜"]
    ),
    *((bad_call(fn=a), ARGS) for a in [{"a": 1}, "", "[1]", "{'a': 1}", '{"a": NaN}', '{"a": -Infinity}']),
    *((bad_call(fn=a), ARGS) for a in ['{"a": 1e400}', '{"a": 1, "a": 2}', '{"a": {"b": 1, "b": 1}}']),
    *((bad_call(fn=a), ARGS) for a in ['{"a\\"b": 1}', '{"": 1}', '{"a": "</think>"}']),
    (bad_call(fn='{"a": ["\\uff5cDSML\\uff5c"]}'), ARGS),  # a JSON escape must not smuggle a fragment in
    # Nor a lone surrogate, which no tokenizer can encode.
    *((bad_call(fn=a), ARGS) for a in ['{"a": "\\ud800"}', '{"\\udc00": 1}', '{"a": {"b": ["\\ud800x"]}}']),
    (req(user("a\ud800")), "messages[0].content"),
    (req(tool("a", "x")), "messages[0]"),
    (req(user("q"), assistant("no calls"), tool("a", "x")), "messages[2]"),
    (req(*CALLS, tool("c", "x")), "messages[2].tool_call_id"),
    (req(*CALLS, NO_ID), "messages[2].tool_call_id"),
    (req(*CALLS, tool("a", "x"), tool("a", "y")), "messages[3].tool_call_id"),
    (req(*CALLS, tool("a", "x"), tool("b", "<｜DSML｜")), "messages[3].content"),
    (req(*CALLS, tool("a", "x"), assistant("ok"), tool("b", "x")), "messages[4]"),
    (req(user("q"), assistant("", calls=[call("a")]), NO_ID, NO_ID), "messages[3].tool_call_id"),
    (req(user("q"), tools={"name": "f"}), "tools"),
    (req(user("q"), tools="f"), "tools"),
    (req(user("q"), tools=["f"]), "tools[0]"),
    (req(user("q"), tools=[{"function": TOOL["function"]}]), "tools[0]"),
    (req(user("q"), tools=[{"type": "function", "function": "f"}]), "tools[0].function"),
    (bad_tool(name="a>"), "tools[0].function.name"),
    (req(user("q"), tools=[TOOL, TOOL]), "tools[1].function.name"),
    (bad_tool(d=float("nan")), "tools[0].function"),
    (bad_tool(d={1, 2}), "tools[0].function"),
    (bad_tool(d="<think>"), "tools[0].function"),
    (bad_tool(parameters="x"), "tools[0].function.parameters"),
    (bad_tool(parameters=[]), "tools[0].function.parameters"),
    (bad_tool(description=5), "tools[0].function.description"),
    (req(user("q"), response_format="json"), "response_format"),
    (req(user("q"), response_format={"x": float("inf")}), "response_format"),
    (req(user("q"), response_format={"x": "<｜Assistant｜>"}), "response_format"),
    (req(user("q"), reasoning_effort="medium"), "reasoning_effort"),
]


@pytest.mark.parametrize(("request_", "where"), BAD_REQUESTS)
def test_validation_errors_name_the_field(request_, where):
    with pytest.raises(ChatFormatError) as err:
        encode_messages(**request_)
    assert err.value.where == where and str(err.value) == f"{where}: {err.value.problem}"
    assert "messages[" not in err.value.problem and "tools[" not in err.value.problem  # no nested paths
    assert isinstance(err.value, ValueError)
