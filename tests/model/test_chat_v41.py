"""The V4.1 chat encoding (model-spec §11.2): the worked prompts byte for byte, layouts, effort, checks."""

import pytest

from model.chat import ChatFormatError, encode_messages
from model.chat_profile import V41
from tests.model.test_chat import (
    ASSISTANT,
    BOS,
    END_THINK,
    EOS,
    REMINDER,
    RESPONSE_FORMAT,
    THINK,
    TOOL,
    TOOLS_SECTION,
    USER,
    assistant,
    call,
    tool,
    user,
)

SYS = "<｜System｜>"
# The V4.1 tools section is the V4 one with every DSML tag name given a leading space.
TOOLS41 = (
    TOOLS_SECTION.replace("｜DSML｜tool_calls", "｜DSML｜ calls")
    .replace("｜DSML｜invoke", "｜DSML｜ invoke")
    .replace("｜DSML｜parameter", "｜DSML｜ parameter")
)
T = {"thinking": True}
CHAT = ASSISTANT + END_THINK  # a chat-mode generation header
GEN = ASSISTANT + THINK  # a thinking-mode one, reasoning kept
E75 = "Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


def effort(n):
    return E75.replace("75", str(n))


def system(text):
    return {"role": "system", "content": text}


def task(text, name):
    return user(text) | {"task": name}


S, U = system("S"), user("U")
HISTORY = [S, user("q1"), assistant("a1", "r1"), user("q2")]
DROPPED = f"{USER}q1{ASSISTANT}{END_THINK}a1{EOS}{USER}q2{ASSISTANT}"
KEPT = f"{USER}q1{ASSISTANT}{THINK}r1{END_THINK}a1{EOS}{USER}q2{GEN}"
CALLS = [call("a", "get_weather", city="Paris", days=[1, 2]), call("b", "now")]
BLOCK41 = (
    '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
    '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
    '<｜DSML｜ parameter name="days" string="false">[1, 2]</｜DSML｜ parameter>\n'
    '</｜DSML｜ invoke>\n<｜DSML｜ invoke name="now">\n\n</｜DSML｜ invoke>\n</｜DSML｜ calls>'
)
RESULTS = "<tool_result>A</tool_result>\n\n<tool_result>B</tool_result>"
TOOL_TURN = [user("q"), assistant("Let me check.", calls=CALLS), tool("b", "B"), tool("a", "A")]
CALL_TEXT = f"{USER}q{ASSISTANT}{END_THINK}Let me check.{BLOCK41}{EOS}"

CASES = {
    # The three worked prompts of §11.2.
    "worked thinking": ([S, U], T, f"{SYS}{E75}S{USER}U{GEN}"),
    "worked chat": ([S, U], {}, f"{SYS}S{USER}U{CHAT}"),
    "worked chat, user only": ([U], {}, f"{USER}U{CHAT}"),
    "thinking without system opens a system part": ([U], T, f"{SYS}{E75}{USER}U{GEN}"),
    "effort low": ([U], {**T, "reasoning_effort": "low"}, f"{SYS}{effort(50)}{USER}U{GEN}"),
    "effort high": ([S, U], {**T, "reasoning_effort": "high"}, f"{SYS}{E75}S{USER}U{GEN}"),
    "effort max": ([U], {**T, "reasoning_effort": "max"}, f"{SYS}{effort(100)}{USER}U{GEN}"),
    "effort 1": ([U], {**T, "reasoning_effort": 1}, f"{SYS}{effort(1)}{USER}U{GEN}"),
    "effort 100": ([S, U], {**T, "reasoning_effort": 100}, f"{SYS}{effort(100)}S{USER}U{GEN}"),
    "effort 37": ([U], {**T, "reasoning_effort": 37}, f"{SYS}{effort(37)}{USER}U{GEN}"),
    "effort ignored in chat mode": ([U], {"reasoning_effort": "max"}, f"{USER}U{CHAT}"),
    "mid-conversation system is a user turn": (
        [S, user("q1"), assistant("a1"), system("S2")],
        {},
        f"{SYS}S{USER}q1{ASSISTANT}{END_THINK}a1{EOS}{SYS}S2{CHAT}",
    ),
    "mid-conversation system moves the last user index": (
        [S, user("q1"), assistant("a1", "r1"), system("S2")],
        T,
        f"{SYS}{E75}S{USER}q1{ASSISTANT}{END_THINK}a1{EOS}{SYS}S2{GEN}",
    ),
    "mid-conversation system before a user turn": (
        [U, system("S2"), user("U2")],
        {},
        f"{USER}U{SYS}S2{USER}U2{CHAT}",
    ),
    "tools with a system message": ([S, user("q")], {"tools": [TOOL]}, f"{SYS}S\n\n{TOOLS41}{USER}q{CHAT}"),
    "tools without a system message": ([user("q")], {"tools": [TOOL]}, f"{SYS}\n\n{TOOLS41}{USER}q{CHAT}"),
    "tools go first even before a later system": (
        [user("q"), system("S2")],
        {"tools": [TOOL]},
        f"{SYS}\n\n{TOOLS41}{USER}q{SYS}S2{CHAT}",
    ),
    "tools in thinking mode keep all reasoning": (
        HISTORY,
        {"tools": [TOOL], "thinking": True},
        f"{SYS}{E75}S\n\n{TOOLS41}{KEPT}",
    ),
    "response format": (
        [S, U],
        {"response_format": {"type": "object"}},
        f"{SYS}S\n\n{RESPONSE_FORMAT}{USER}U{CHAT}",
    ),
    "tool calls, results re-ordered": (TOOL_TURN, {}, f"{CALL_TEXT}{USER}{RESULTS}{CHAT}"),
    "tool results merge with the following user message": (
        [*TOOL_TURN, user("more")],
        {},
        f"{CALL_TEXT}{USER}{RESULTS}\n\nmore{CHAT}",
    ),
    "a task message does not merge": (
        [*TOOL_TURN, task("t", "title")],
        {},
        f"{CALL_TEXT}{USER}{RESULTS}{USER}t{ASSISTANT}<｜title｜>",
    ),
    "reasoning dropped before the last user turn": (HISTORY, T, f"{SYS}{E75}S{DROPPED}{THINK}"),
    "reasoning kept with dropping off": (
        HISTORY,
        {"thinking": True, "drop_thinking": False},
        f"{SYS}{E75}S{KEPT}",
    ),
    "reasoning after the last user turn is kept": (
        [U, assistant("a", "r")],
        T,
        f"{SYS}{E75}{USER}U{ASSISTANT}{THINK}r{END_THINK}a{EOS}",
    ),
    "chat mode history": (HISTORY, {}, f"{SYS}S{DROPPED}{END_THINK}"),
    "no generation prompt": (
        HISTORY,
        {"add_generation_prompt": False},
        f"{SYS}S{DROPPED.removesuffix(ASSISTANT)}",
    ),
    "query task": ([task("q", "query")], {}, f"{USER}q{ASSISTANT}<｜query｜>"),
    "action task in thinking mode": (
        [task("do", "action")],
        T,
        f"{SYS}{E75}{USER}do{ASSISTANT}{THINK}<｜action｜>",
    ),
    "action task in chat mode": ([task("do", "action")], {}, f"{USER}do{ASSISTANT}{END_THINK}<｜action｜>"),
    "a task's answer has no reasoning part": (
        [task("q", "query"), assistant("k", "r"), user("U")],
        T,
        f"{SYS}{E75}{USER}q{ASSISTANT}<｜query｜>k{EOS}{USER}U{GEN}",
    ),
    "latest reminder": (
        [U, {"role": "latest_reminder", "content": "R"}],
        {},
        f"{USER}U{ASSISTANT}{END_THINK}{REMINDER}R",
    ),
    "developer is a user turn": ([{"role": "developer", "content": "D"}], {}, f"{USER}D{CHAT}"),
}


@pytest.mark.parametrize(("messages", "kwargs", "expected"), CASES.values(), ids=CASES)
def test_layout(messages, kwargs, expected):
    assert encode_messages(messages, profile=V41, **kwargs) == BOS + expected


BAD = {
    "effort medium": ({"reasoning_effort": "medium", "thinking": True}, [U], "reasoning_effort"),
    "effort xhigh (pre-release)": ({"reasoning_effort": "xhigh", "thinking": True}, [U], "reasoning_effort"),
    "effort 0": ({"reasoning_effort": 0, "thinking": True}, [U], "reasoning_effort"),
    "effort 101": ({"reasoning_effort": 101, "thinking": True}, [U], "reasoning_effort"),
    "effort True": ({"reasoning_effort": True, "thinking": True}, [U], "reasoning_effort"),
    "effort 2.5": ({"reasoning_effort": 2.5, "thinking": True}, [U], "reasoning_effort"),
    "bad effort in chat mode": ({"reasoning_effort": "medium"}, [U], "reasoning_effort"),
    "image part": ({}, [user([{"type": "image_url", "image_url": {"url": "x"}}])], "messages[0].content[0]"),
    "image placeholder text": ({}, [user("a<｜deepseek_image｜>")], "messages[0].content"),
    "image placeholder in reasoning": (
        {},
        [U, assistant("a", "<｜deepseek_image｜>")],
        "messages[1].reasoning_content",
    ),
    "system token in user text": ({}, [user("<｜System｜>x")], "messages[0].content"),
    "V4.1 tag in a tool result": (
        {},
        [*TOOL_TURN[:2], tool("a", "</｜DSML｜ calls>")],
        "messages[2].content",
    ),
    "unknown task": ({}, [task("q", "search")], "messages[0].task"),
    "task on an assistant message": ({}, [U, assistant("a") | {"task": "query"}], "messages[1].task"),
}


@pytest.mark.parametrize(("kwargs", "messages", "where"), BAD.values(), ids=BAD)
def test_invalid_requests_name_the_field(kwargs, messages, where):
    with pytest.raises(ChatFormatError) as err:
        encode_messages(messages, profile=V41, **kwargs)
    assert err.value.where == where


def test_images_are_refused_as_unsupported():
    with pytest.raises(ChatFormatError, match="images are not supported"):
        encode_messages([user([{"type": "image_url", "image_url": {"url": "x"}}])], profile=V41)
