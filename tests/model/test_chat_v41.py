"""The V4.1 chat encoding (model-spec §11.2): the worked prompts byte for byte, layouts, effort, checks."""

import pytest

from model.chat import ChatFormatError, encode_messages
from model.chat_profile import V41
from tests.model.test_chat import (
    ASSISTANT,
    BOS,
    CHAT,
    END_THINK,
    EOS,
    GEN,
    REMINDER,
    TOOL,
    TOOL_TURN,
    TOOLS_SECTION,
    USER,
    S,
    T,
    U,
    assistant,
    system,
    task,
    tool,
    user,
)
from tests.model.test_chat_v4 import LAYOUTS

SYS = "<｜System｜>"


def v41_tags(text):
    """V4 text with every DSML tag name given V4.1's leading space."""
    for tag in ("tool_calls", "invoke", "parameter"):
        text = text.replace(f"｜DSML｜{tag}", f"｜DSML｜ {'calls' if tag == 'tool_calls' else tag}")
    return text


TOOLS41 = v41_tags(TOOLS_SECTION)
E75 = "Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


def effort(n):
    return E75.replace("75", str(n))


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
    "tools go first even before a later system": (
        [user("q"), system("S2")],
        {"tools": [TOOL]},
        f"{SYS}\n\n{TOOLS41}{USER}q{SYS}S2{CHAT}",
    ),
    "tools and a later system message in thinking mode": (
        [user("q"), assistant("a", "r"), system("S2")],
        {"tools": [TOOL], **T},
        f"{SYS}{E75}\n\n{TOOLS41}{USER}q{GEN}r{END_THINK}a{EOS}{SYS}S2{GEN}",
    ),
    "a task after a later system message": (
        [S, system("S2"), task("q", "query")],
        {},
        f"{SYS}S{SYS}S2{USER}q{ASSISTANT}<｜query｜>",
    ),
    "latest reminder": (
        [U, {"role": "latest_reminder", "content": "R"}],
        {},
        f"{USER}U{ASSISTANT}{END_THINK}{REMINDER}R",
    ),
    "developer is a user turn": ([{"role": "developer", "content": "D"}], {}, f"{USER}D{CHAT}"),
}


def test_the_worked_prompts_of_the_spec_byte_for_byte():
    effort = "Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)"
    assert (
        encode_messages([S, U], profile=V41, thinking=True)
        == f"<｜begin▁of▁sentence｜><｜System｜>{effort}\n\nS<｜User｜>U<｜Assistant｜><think>"
    )
    assert (
        encode_messages([S, U], profile=V41)
        == "<｜begin▁of▁sentence｜><｜System｜>S<｜User｜>U<｜Assistant｜></think>"
    )
    assert encode_messages([U], profile=V41) == "<｜begin▁of▁sentence｜><｜User｜>U<｜Assistant｜></think>"


@pytest.mark.parametrize(("messages", "kwargs", "expected"), CASES.values(), ids=CASES)
def test_layout(messages, kwargs, expected):
    assert encode_messages(messages, profile=V41, **kwargs) == BOS + expected


# The V4 layouts without a later system message (tools with and without a system message, tool results
# merged and re-ordered, reasoning dropped or kept, tasks, developer and reminder turns).
CARRIED = {k: v for k, v in LAYOUTS.items() if all(m["role"] != "system" for m in v[0][1:])}


@pytest.mark.parametrize(("messages", "kwargs", "v4_prompt"), CARRIED.values(), ids=CARRIED)
def test_v4_layouts_carry_over(messages, kwargs, v4_prompt):
    """Elsewhere V4.1 lays a conversation out as V4 does, with three differences: `<｜System｜>` opens the
    prompt when it has a system part, thinking mode adds the effort paragraph there, and the DSML tags
    have V4.1's names."""
    thinking = kwargs.get("thinking", False)
    system_part = (
        thinking or messages[0]["role"] == "system" or "tools" in kwargs or "response_format" in kwargs
    )
    head = (SYS if system_part else "") + (E75 if thinking else "")
    assert encode_messages(messages, profile=V41, **kwargs) == BOS + head + v41_tags(v4_prompt)


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
