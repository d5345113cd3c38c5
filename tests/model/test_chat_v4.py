"""The V4 encodings (model-spec §11, §11.1): the first release and 0731 share every layout and differ only
in their effort levels; the choice of profile per checkpoint (§11.3) and OpenAI's effort names."""

import pytest

from model import generate
from model.chat import ChatFormatError, encode_messages
from model.chat_profile import PROFILES, V4, V4_0731, V41, select_chat_profile
from tests.model.test_chat import (
    ASSISTANT,
    BLOCK,
    BOS,
    CHAT,
    END_THINK,
    EOS,
    GEN,
    HIGH,
    HISTORY,
    KEPT,
    MAX,
    REMINDER,
    RESPONSE_FORMAT,
    RESULTS,
    THINK,
    TOOL,
    TOOL_TURN,
    TOOLS_SECTION,
    TURNS,
    USER,
    S,
    T,
    U,
    assistant,
    system,
    task,
    user,
)

CALL_TEXT = f"{USER}q{CHAT}Let me check.{BLOCK}{EOS}"
DEV = {"role": "developer", "content": "D"}

# Layouts without an effort level: the same for both V4 revisions.
LAYOUTS = {
    "chat": ([S, U], {}, f"S{USER}U{CHAT}"),
    "chat, user only": ([U], {}, f"{USER}U{CHAT}"),
    "thinking, default effort adds nothing": ([S, U], T, f"S{USER}U{GEN}"),
    "a later system message is plain text, not a turn": (
        [user("q1"), assistant("a1"), system("S2"), user("q2")],
        {},
        f"{USER}q1{CHAT}a1{EOS}S2{USER}q2{CHAT}",
    ),
    "a system message after a user turn takes no header": ([U, system("S2")], {}, f"{USER}US2"),
    "tools with a system message": ([S, user("q")], {"tools": [TOOL]}, f"S\n\n{TOOLS_SECTION}{USER}q{CHAT}"),
    "tools without a system message": ([user("q")], {"tools": [TOOL]}, f"\n\n{TOOLS_SECTION}{USER}q{CHAT}"),
    "tools go to the first system message wherever it is": (
        [user("q"), system("S2")],
        {"tools": [TOOL]},
        f"{USER}qS2\n\n{TOOLS_SECTION}",
    ),
    "tools in thinking mode keep all reasoning": (
        HISTORY,
        {"tools": [TOOL], **T},
        f"S\n\n{TOOLS_SECTION}{KEPT}",
    ),
    "response format": (
        [S, U],
        {"response_format": {"type": "object"}},
        f"S\n\n{RESPONSE_FORMAT}{USER}U{CHAT}",
    ),
    "tool calls, results re-ordered": (TOOL_TURN, {}, f"{CALL_TEXT}{USER}{RESULTS}{CHAT}"),
    "tool results merge with the following user message": (
        [*TOOL_TURN, user("more")],
        {},
        f"{CALL_TEXT}{USER}{RESULTS}\n\nmore{CHAT}",
    ),
    "a task message does not merge": (
        [*TOOL_TURN, task("t", "domain")],
        {},
        f"{CALL_TEXT}{USER}{RESULTS}{USER}t{ASSISTANT}<｜domain｜>",
    ),
    "reasoning dropped before the last user turn": (HISTORY, T, f"S{TURNS}{THINK}"),
    "reasoning kept with dropping off": (HISTORY, {**T, "drop_thinking": False}, f"S{KEPT}"),
    "reasoning after the last user turn is kept": (
        [U, assistant("a", "r")],
        T,
        f"{USER}U{GEN}r{END_THINK}a{EOS}",
    ),
    "chat mode history": (HISTORY, {}, f"S{TURNS}{END_THINK}"),
    "no generation prompt": (
        HISTORY,
        {"add_generation_prompt": False},
        f"S{TURNS.removesuffix(ASSISTANT)}",
    ),
    "developer turn": ([DEV, assistant("a"), user("q")], {}, f"{USER}D{CHAT}a{EOS}{USER}q{CHAT}"),
    "developer dropped before the last user turn": (
        [DEV, assistant("a"), user("q")],
        T,
        f"a{EOS}{USER}q{GEN}",
    ),
    "latest reminder": ([{"role": "latest_reminder", "content": "R"}, U], {}, f"{REMINDER}R{USER}U{CHAT}"),
    "read_url task": ([task("u", "read_url")], {}, f"{USER}u{ASSISTANT}<｜read_url｜>"),
    "action task in thinking mode": ([task("do", "action")], T, f"{USER}do{GEN}<｜action｜>"),
    "action task in chat mode": ([task("do", "action")], {}, f"{USER}do{CHAT}<｜action｜>"),
    "a task's answer has no reasoning part": (
        [task("q", "authority"), assistant("k", "r"), user("U")],
        T,
        f"{USER}q{ASSISTANT}<｜authority｜>k{EOS}{USER}U{GEN}",
    ),
}


@pytest.mark.parametrize("profile", [V4, V4_0731], ids=["v4", "v4-0731"])
@pytest.mark.parametrize(("messages", "kwargs", "expected"), LAYOUTS.values(), ids=LAYOUTS)
def test_layout(profile, messages, kwargs, expected):
    assert encode_messages(messages, profile=profile, **kwargs) == BOS + expected


# The first release: high (the default) adds nothing, max adds the text 0731 uses for high.
EFFORTS = [
    (V4, None, ""),
    (V4, "high", ""),
    (V4, "max", HIGH),
    (V4_0731, None, ""),
    (V4_0731, "low", ""),
    (V4_0731, "high", HIGH),
    (V4_0731, "max", MAX),
]


@pytest.mark.parametrize(("profile", "effort", "prefix"), EFFORTS)
def test_effort_prefix(profile, effort, prefix):
    thinking = encode_messages([S, U], profile=profile, thinking=True, reasoning_effort=effort)
    assert thinking == f"{BOS}{prefix}S{USER}U{GEN}"
    assert encode_messages([S, U], profile=profile, reasoning_effort=effort) == f"{BOS}S{USER}U{CHAT}"


@pytest.mark.parametrize(
    ("profile", "effort"),
    [(V4, "low"), (V4, "medium"), (V4, 75), (V4_0731, "medium"), (V4_0731, "xhigh"), (V4_0731, 100)],
)
@pytest.mark.parametrize("thinking", [True, False])
def test_invalid_effort_is_rejected_in_both_modes(profile, effort, thinking):
    with pytest.raises(ChatFormatError) as err:
        encode_messages([U], profile=profile, thinking=thinking, reasoning_effort=effort)
    assert err.value.where == "reasoning_effort" and profile.name in err.value.problem


IMAGE_URL = {"type": "image_url", "image_url": {"url": "u"}}


@pytest.mark.parametrize("profile", PROFILES.values(), ids=PROFILES)
@pytest.mark.parametrize(
    ("messages", "where", "problem"),
    [
        ([user([IMAGE_URL])], "messages[0].content[0]", "images are not supported"),
        (
            [user([{"type": "text", "text": "a"}, {"type": "image", "image": "b"}])],
            "messages[0].content[1]",
            "images",
        ),
        ([user("<｜deepseek_image｜>")], "messages[0].content", "reserved"),
        ([task("q", "search")], "messages[0].task", "must be one of"),
        ([task("q", 3)], "messages[0].task", "must be one of"),
        ([S | {"task": "query"}], "messages[0].task", "is not a field of system messages"),
    ],
)
def test_images_and_bad_tasks_are_rejected(profile, messages, where, problem):
    with pytest.raises(ChatFormatError) as err:
        encode_messages(messages, profile=profile)
    assert err.value.where == where and problem in err.value.problem


# OpenAI's names on each profile (docs/serving.md); None: the profile's default or chat mode.
OPENAI = {
    "none": (None, None, None),
    "minimal": ("high", "low", "low"),
    "low": ("high", "low", "low"),
    "medium": ("high", "low", "high"),
    "high": ("high", "high", "high"),
    "xhigh": ("max", "max", "max"),
    "max": ("max", "max", "max"),
    None: (None, None, None),
}


@pytest.mark.parametrize(("name", "values"), OPENAI.items())
def test_openai_effort_names(name, values):
    assert [p.openai_effort(name) for p in (V4, V4_0731, V41)] == list(values)


def test_openai_effort_numbers_only_for_v41():
    assert V41.openai_effort(42) == 42
    with pytest.raises(ValueError, match="none turns thinking off"):
        V41.openai_effort("none", thinking=True)
    for profile, bad in [(V4, 42), (V4_0731, 42), (V41, 0), (V41, 101), (V41, "extreme"), (V41, True)]:
        with pytest.raises(ValueError, match=profile.name):
            profile.openai_effort(bad)


def test_profile_selection(tmp_path):
    assert select_chat_profile("deepseek_v41", tmp_path) is V41
    assert select_chat_profile("deepseek_v4", tmp_path) is V4_0731  # no encoder file: 0731, as other servers
    assert select_chat_profile("deepseek_v4") is V4_0731
    encoder = tmp_path / "encoding" / "encoding_dsv4.py"
    encoder.parent.mkdir()
    encoder.write_text(f"EFFORT = {{'max': {HIGH!r}}}\n")
    assert select_chat_profile("deepseek_v4", tmp_path) is V4
    encoder.write_text(f"EFFORT = {{'high': {HIGH!r}, 'max': {MAX!r}}}\n")
    assert select_chat_profile("deepseek_v4", tmp_path) is V4_0731
    with pytest.raises(ValueError, match="deepseek_v3"):
        select_chat_profile("deepseek_v3", tmp_path)
    assert select_chat_profile("deepseek_v41", tmp_path, override="v4") is V4  # --chat-encoding
    with pytest.raises(ValueError, match="v5"):
        select_chat_profile("deepseek_v41", tmp_path, override="v5")


@pytest.mark.parametrize(("argv", "profile"), [([], "v41"), (["--chat-encoding", "v4"], "v4")])
def test_generate_chat_uses_the_checkpoints_encoding(capsys, argv, profile):
    generate.main(["--arch", "v41", "--chat", "--prompt", "Hi", "--max-tokens", "1", *argv])
    assert capsys.readouterr().out.startswith(f"chat encoding: {profile}\n")
