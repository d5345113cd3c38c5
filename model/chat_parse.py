"""Parsing DeepSeek V4 / V4.1 completions (model-spec §11, §11.2): reasoning/content split, DSML tool calls.

A completion is the generated text up to, not including, EOS. In thinking mode it is `reasoning</think>`
followed by content; text that never reaches `</think>` (a length cut) is all reasoning. Content ends
where the profile's tool-call prefix (`\\n\\n<｜DSML｜tool_calls`, V4.1 `\\n\\n<｜DSML｜ calls`) starts;
from there the text must be exactly one tool-call block as the encoder renders it, and nothing may follow
it. In V4.1 a tool-call block inside the reasoning is malformed. `parse_completion` is the streaming parser
fed once, so streamed and non-streamed results agree by construction whatever the split.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

from model.chat import NAME_RE, loads_strict
from model.chat_profile import V4_0731, ChatProfile
from model.tokenizer import DSML, THINK_END


@dataclass(frozen=True)
class _Tags:
    """A profile's DSML block as the parser reads it."""

    invoke: re.Pattern[str]
    param: re.Pattern[str]
    invoke_end: str
    next_invoke: str
    block_end: str


@cache
def _tags(p: ChatProfile) -> _Tags:
    name, invoke, param = NAME_RE.pattern, re.escape(p.invoke_tag), re.escape(p.parameter_tag)
    return _Tags(
        re.compile(rf'<{DSML}{invoke} name="({name})">\n(.*)\n</{DSML}{invoke}>', re.S),
        re.compile(rf'<{DSML}{param} name="({name})" string="(true|false)">(.*?)</{DSML}{param}>', re.S),
        f"</{DSML}{p.invoke_tag}>",
        f"\n<{DSML}{p.invoke_tag}",
        f"\n</{DSML}{p.calls_tag}>",
    )


class CompletionParseError(ValueError):
    """Generated text that announces tool calls but does not follow the DSML grammar."""


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI clients expect

    def to_openai(self) -> dict[str, object]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass
class ParsedCompletion:
    reasoning_content: str | None  # None outside thinking mode
    content: str
    tool_calls: list[ToolCall]


@dataclass
class StreamDelta:
    reasoning_content: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


def _default_id(index: int) -> str:
    return f"call_{index}"


def held_back(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that could still grow into `marker` (a proper prefix of it):
    what a stream must hold back. Only the places in the last len(marker) - 1 characters where the
    marker's first character stands are tried."""
    start = text.find(marker[0], max(0, len(text) - len(marker) + 1))
    while start >= 0:
        if marker.startswith(text[start:]):
            return len(text) - start
        start = text.find(marker[0], start + 1)
    return 0


def _parse_invoke(text: str, tags: _Tags) -> tuple[str, str]:
    """Name and JSON-object arguments of one `<｜DSML｜invoke ...>...</｜DSML｜invoke>` element."""
    m = tags.invoke.fullmatch(text)
    if m is None:
        raise CompletionParseError(f"malformed tool call {text[:200]!r}")
    name, body = m.groups()
    args: dict[str, object] = {}
    pos = 0
    while body:  # parameters joined by newlines; none at all leaves the body empty
        p = tags.param.match(body, pos)
        if p is None:
            raise CompletionParseError(f"malformed parameter in {name!r}: {body[pos : pos + 200]!r}")
        key, is_string, value = p.groups()
        if key in args:
            raise CompletionParseError(f"duplicate parameter {key!r} in tool call {name!r}")
        try:
            args[key] = value if is_string == "true" else loads_strict(value)
        except ValueError as err:
            raise CompletionParseError(f"parameter {key!r} of tool call {name!r}: {err}") from None
        pos = p.end()
        if pos == len(body):
            break
        if body[pos] != "\n":
            raise CompletionParseError(f"expected a newline after parameter {key!r} of tool call {name!r}")
        pos += 1
    return name, json.dumps(args, ensure_ascii=False)


class StreamParser:
    """Incremental parse: feed text deltas, get reasoning/content deltas and each tool call once complete.

    Text that could be the start of `</think>` or of the tool-call prefix is held back until the next
    delta decides it; finish() flushes the rest and raises if a tool-call block was left unterminated.
    After a CompletionParseError the parser is spent.
    """

    def __init__(
        self,
        *,
        thinking: bool,
        id_factory: Callable[[int], str] | None = None,
        profile: ChatProfile = V4_0731,
    ) -> None:
        self._prefix, self._tags = profile.tool_calls_prefix, _tags(profile)
        self._strict_reasoning = profile.v41
        self._state = "reasoning" if thinking else "content"
        self._buf = ""
        self._new_id = id_factory or _default_id
        self._ids: set[str] = set()

    def feed(self, text: str) -> StreamDelta:
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> StreamDelta:
        delta = self._advance(final=True)
        if self._state in ("open", "invoke", "between"):
            raise CompletionParseError(f"unterminated tool-call block (pending {self._buf[:200]!r})")
        return delta

    def _advance(self, final: bool) -> StreamDelta:
        delta = StreamDelta()
        while True:
            buf = self._buf
            if self._state in ("reasoning", "content"):
                marker = THINK_END if self._state == "reasoning" else self._prefix
                at = buf.find(marker)
                end = at if at >= 0 else len(buf) - (0 if final else held_back(buf, marker))
                if self._state == "reasoning" and self._strict_reasoning:
                    early = buf.find(self._prefix, 0, at if at >= 0 else len(buf))
                    if early >= 0:
                        raise CompletionParseError(
                            f"tool-call block inside the reasoning: {buf[early : early + 200]!r}"
                        )
                    if at < 0 and not final:
                        end = min(end, len(buf) - held_back(buf, self._prefix))
                if self._state == "reasoning":
                    delta.reasoning_content += buf[:end]
                else:
                    delta.content += buf[:end]
                if at < 0:
                    self._buf = buf[end:]
                    return delta
                self._buf = buf[at + len(marker) :]
                self._state = "open" if self._state == "content" else "content"
            elif self._state == "open":  # right after the prefix: the tag closes, then the first invoke
                if not buf:
                    return delta
                if buf[0] != ">":
                    raise CompletionParseError(f"malformed tool-call block start: {buf[:200]!r}")
                self._buf, self._state = buf[1:], "between"
            elif self._state == "between":
                tags = self._tags
                if buf.startswith(tags.next_invoke):
                    self._buf, self._state = buf[1:], "invoke"
                elif buf.startswith(tags.block_end) and self._ids:
                    self._buf, self._state = buf[len(tags.block_end) :], "done"
                elif not (tags.next_invoke.startswith(buf) or (tags.block_end.startswith(buf) and self._ids)):
                    raise CompletionParseError(f"expected a tool call or the end of the block: {buf[:200]!r}")
                else:
                    return delta
            elif self._state == "invoke":
                end = buf.find(self._tags.invoke_end)
                if end < 0:
                    return delta
                end += len(self._tags.invoke_end)
                name, arguments = _parse_invoke(buf[:end], self._tags)
                delta.tool_calls.append(ToolCall(self._next_id(), name, arguments))
                self._buf, self._state = buf[end:], "between"
            else:
                if buf:
                    raise CompletionParseError(f"text after the tool-call block: {buf[:200]!r}")
                return delta

    def _next_id(self) -> str:
        call_id = self._new_id(len(self._ids))
        # A factory repeating itself would hand clients ambiguous results to send back.
        if not isinstance(call_id, str) or not call_id or call_id in self._ids:
            raise ValueError(f"id factory returned {call_id!r}, not a fresh non-empty string")
        self._ids.add(call_id)
        return call_id


def parse_completion(
    text: str,
    *,
    thinking: bool,
    id_factory: Callable[[int], str] | None = None,
    profile: ChatProfile = V4_0731,
) -> ParsedCompletion:
    """Split a whole completion; tool-call ids come from id_factory(index), default `call_{index}`."""
    parser = StreamParser(thinking=thinking, id_factory=id_factory, profile=profile)
    head, tail = parser.feed(text), parser.finish()
    return ParsedCompletion(
        head.reasoning_content + tail.reasoning_content if thinking else None,
        head.content + tail.content,
        head.tool_calls + tail.tool_calls,
    )
