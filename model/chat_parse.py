"""Parsing DeepSeek V4 completions (model-spec §11): reasoning/content split and DSML tool calls.

A completion is the generated text up to, not including, EOS. In thinking mode it is `reasoning</think>`
followed by content; text that never reaches `</think>` (a length cut) is all reasoning. Content ends
where `\\n\\n<｜DSML｜tool_calls` starts; from there the text must be exactly one tool-call block as the
encoder renders it, and nothing may follow it. `parse_completion` is the streaming parser fed once, so
streamed and non-streamed results agree by construction whatever the split.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from model.chat import NAME_RE, TOOL_CALLS_PREFIX, loads_strict
from model.tokenizer import DSML, THINK_END

_INVOKE_RE = re.compile(rf'<{DSML}invoke name="({NAME_RE.pattern})">\n(.*)\n</{DSML}invoke>', re.S)
_PARAM_RE = re.compile(
    rf'<{DSML}parameter name="({NAME_RE.pattern})" string="(true|false)">(.*?)</{DSML}parameter>', re.S
)
_INVOKE_END = f"</{DSML}invoke>"
_NEXT_INVOKE = f"\n<{DSML}invoke"
_BLOCK_END = f"\n</{DSML}tool_calls>"


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


def _held_back(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that could still grow into `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _parse_invoke(text: str) -> tuple[str, str]:
    """Name and JSON-object arguments of one `<｜DSML｜invoke ...>...</｜DSML｜invoke>` element."""
    m = _INVOKE_RE.fullmatch(text)
    if m is None:
        raise CompletionParseError(f"malformed tool call {text[:200]!r}")
    name, body = m.groups()
    args: dict[str, object] = {}
    pos = 0
    while body:  # parameters joined by newlines; none at all leaves the body empty
        p = _PARAM_RE.match(body, pos)
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

    def __init__(self, *, thinking: bool, id_factory: Callable[[int], str] | None = None) -> None:
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
                marker = THINK_END if self._state == "reasoning" else TOOL_CALLS_PREFIX
                at = buf.find(marker)
                end = at if at >= 0 else len(buf) - (0 if final else _held_back(buf, marker))
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
                if buf.startswith(_NEXT_INVOKE):
                    self._buf, self._state = buf[1:], "invoke"
                elif buf.startswith(_BLOCK_END) and self._ids:
                    self._buf, self._state = buf[len(_BLOCK_END) :], "done"
                elif not (_NEXT_INVOKE.startswith(buf) or (_BLOCK_END.startswith(buf) and self._ids)):
                    raise CompletionParseError(f"expected a tool call or the end of the block: {buf[:200]!r}")
                else:
                    return delta
            elif self._state == "invoke":
                end = buf.find(_INVOKE_END)
                if end < 0:
                    return delta
                end += len(_INVOKE_END)
                name, arguments = _parse_invoke(buf[:end])
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
    text: str, *, thinking: bool, id_factory: Callable[[int], str] | None = None
) -> ParsedCompletion:
    """Split a whole completion; tool-call ids come from id_factory(index), default `call_{index}`."""
    parser = StreamParser(thinking=thinking, id_factory=id_factory)
    head, tail = parser.feed(text), parser.finish()
    return ParsedCompletion(
        head.reasoning_content + tail.reasoning_content if thinking else None,
        head.content + tail.content,
        head.tool_calls + tail.tool_calls,
    )
