"""Output shaping: stop strings held back, reasoning/content/tool-call splits, and the content fallback."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.server.output import ChatChoice, TextRelease, TokenTexts
from model.chat_profile import V4_0731, V41
from model.tokenizer import DSML, THINK_END, load_tokenizer

BLOCK = (
    f'\n\n<{DSML}tool_calls>\n<{DSML}invoke name="f">\n<{DSML}parameter name="x" string="false">1'
    f"</{DSML}parameter>\n</{DSML}invoke>\n</{DSML}tool_calls>"
)
BLOCK41 = (
    f'\n\n<{DSML} calls>\n<{DSML} invoke name="f">\n<{DSML} parameter name="x" string="false">1'
    f"</{DSML} parameter>\n</{DSML} invoke>\n</{DSML} calls>"
)


def run(choice: ChatChoice, pieces: list[str], finish: str = "stop") -> tuple[str, str, list, str | None]:
    """Feed growing text as the engine reports it; return (reasoning, content, calls, finish reason)."""
    reasoning = content = ""
    calls, reason, text = [], None, ""
    for k, piece in enumerate(pieces):
        text += piece
        d, reason = choice.advance(text, finish if k == len(pieces) - 1 else None)
        reasoning, content, calls = reasoning + d.reasoning_content, content + d.content, calls + d.tool_calls
    return reasoning, content, calls, reason


def test_stop_string_prefixes_are_held_back():
    release = TextRelease(("END",))
    assert release.next("abc E", final=False) == "abc "
    assert release.next("abc EN", final=False) == ""
    assert release.next("abc ENx", final=False) == "ENx"
    assert release.next("abc ENx", final=True) == ""


def pieces_at(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({min(c, len(text)) for c in cuts} | {len(text)})
    return [text[a:b] for a, b in zip([0, *bounds], bounds, strict=False)]


@pytest.mark.parametrize(("profile", "block"), [(V4_0731, BLOCK), (V41, BLOCK41)], ids=["v4", "v41"])
@given(cuts=st.lists(st.integers(1, 60), max_size=6))
def test_any_split_gives_the_whole_reply(profile, block, cuts: list[int]):
    pieces = pieces_at(f"hmm{THINK_END}Sure." + block, cuts)
    choice = ChatChoice((), thinking=True, tools_enabled=True, profile=profile)
    reasoning, content, calls, reason = run(choice, pieces)
    assert (reasoning, content, reason) == ("hmm", "Sure.", "tool_calls")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1})]
    # The other release's tags are plain content.
    other = BLOCK if profile is V41 else BLOCK41
    choice = ChatChoice((), thinking=True, tools_enabled=True, profile=profile)
    reply = run(choice, pieces_at(f"hmm{THINK_END}Sure." + other, cuts))
    assert reply == ("hmm", "Sure." + other, [], "stop")


@given(st.lists(st.integers(1, 60), max_size=6))
def test_a_v41_block_inside_the_reasoning_stays_text(cuts: list[int]):
    text = f"hmm{BLOCK41}more{THINK_END}Sure."
    choice = ChatChoice((), thinking=True, tools_enabled=True, profile=V41)
    assert run(choice, pieces_at(text, cuts)) == (f"hmm{BLOCK41}more", "Sure.", [], "stop")
    unfinished = ChatChoice((), thinking=True, tools_enabled=True, profile=V41)
    assert run(unfinished, pieces_at(text[:-12], cuts), "length") == (text[:-12], "", [], "length")


def test_broken_or_forbidden_tool_calls_become_content():
    broken = BLOCK.replace("</｜DSML｜invoke>", "oops")
    _, content, calls, reason = run(ChatChoice((), thinking=False, tools_enabled=True), ["Hi", broken])
    assert (content, calls, reason) == ("Hi" + broken, [], "stop")
    _, content, calls, _ = run(ChatChoice((), thinking=False, tools_enabled=False), ["Hi" + BLOCK])
    assert (content, calls) == ("Hi" + BLOCK, [])
    _, content, _, reason = run(
        ChatChoice((), thinking=False, tools_enabled=True), ["Hi", BLOCK[:30]], "length"
    )
    assert (content, reason) == ("Hi" + BLOCK[:30], "length")


def test_token_bytes_of_partial_characters():
    texts = TokenTexts(load_tokenizer())
    ids = texts.tokenizer.encode("é", add_special_tokens=False).ids
    assert b"".join(texts.token_bytes(t) for t in ids) == "é".encode()
    entry = texts.entry(ids[0], -0.5)
    assert entry["logprob"] == -0.5 and bytes(entry["bytes"]) == texts.token_bytes(ids[0])
