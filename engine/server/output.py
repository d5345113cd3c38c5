"""Turning a sequence's progress into OpenAI output: released text, chat message parts, logprobs.

Streamed and non-streamed responses go through the same objects (non-streaming feeds the final text
once), so their concatenated content is the same by construction.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from tokenizers import Tokenizer

from engine.prompt_logprobs import PromptLogprob, as_vllm
from model.chat_parse import CompletionParseError, StreamDelta, StreamParser, ToolCall, held_back
from model.chat_profile import V4_0731, ChatProfile
from model.tokenizer import THINK_END


class TextRelease:
    """The text a client may see so far: a tail that could begin a stop string is held back until the
    engine decides, so streamed text never includes (part of) the stop string the final text is cut at."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.sent = stops, 0

    def next(self, text: str, final: bool) -> str:
        if not final:
            text = text[: len(text) - max((held_back(text, s) for s in self.stops), default=0)]
        new = text[self.sent :]
        self.sent = max(self.sent, len(text))
        return new


def new_call_id(index: int) -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChatChoice:
    """One chat choice: the engine's text, released past stop strings, parsed into message parts."""

    def __init__(
        self, stops: tuple[str, ...], thinking: bool, tools_enabled: bool, profile: ChatProfile = V4_0731
    ):
        self.release, self.output = TextRelease(stops), ChatOutput(thinking, tools_enabled, profile)

    def advance(self, text: str, finish_reason: str | None) -> tuple[StreamDelta, str | None]:
        """The new message parts, and the finish reason once finished (tool_calls when it called tools)."""
        delta = self.output.feed(self.release.next(text, finish_reason is not None))
        if finish_reason is None:
            return delta, None
        tail = self.output.finish()
        delta = StreamDelta(
            delta.reasoning_content + tail.reasoning_content, delta.content + tail.content, tail.tool_calls
        )
        return delta, "tool_calls" if delta.tool_calls else finish_reason


class ChatOutput:
    """Reasoning, content and tool calls of one choice, from the generated text.

    Parsed with the profile's parser. Tool calls are handed out once the block is complete, at finish.
    Text that announces tool calls but breaks the DSML grammar (or calls tools when none may be called) is
    delivered as content from the point where the content stopped, so nothing generated is lost and no
    error reaches the client.
    """

    def __init__(self, thinking: bool, tools_enabled: bool, profile: ChatProfile = V4_0731):
        self.thinking, self.tools_enabled = thinking, tools_enabled
        self.parser = StreamParser(thinking=thinking, id_factory=new_call_id, profile=profile)
        self.text = self.reasoning = self.content = ""
        self.calls: list[ToolCall] = []
        self.failed = False

    def feed(self, text: str) -> StreamDelta:
        self.text += text
        if not self.failed:
            try:
                d = self.parser.feed(text)
            except CompletionParseError:
                self.failed = True
            else:
                self.calls += d.tool_calls
                return self._add(d.reasoning_content, d.content)
        return self._as_text(final=False)

    def finish(self) -> StreamDelta:
        if not self.failed:
            try:
                d = self.parser.finish()
            except CompletionParseError:
                self.failed = True
            else:
                calls = self.calls + d.tool_calls
                if self.tools_enabled or not calls:
                    delta = self._add(d.reasoning_content, d.content)
                    delta.tool_calls = calls
                    return delta
                self.failed = True
        return self._as_text(final=True)

    def _add(self, reasoning: str, content: str) -> StreamDelta:
        self.reasoning += reasoning
        self.content += content
        return StreamDelta(reasoning, content)

    def _as_text(self, final: bool) -> StreamDelta:
        """After a parse failure: reasoning up to `</think>`, the rest content, tool-call syntax and all."""
        reasoning, content = "", self.text
        if self.thinking:
            reasoning, seen, content = self.text.partition(THINK_END)
            if not seen and not final:
                reasoning = reasoning[: len(reasoning) - held_back(reasoning, THINK_END)]
        return self._add(reasoning[len(self.reasoning) :], content[len(self.content) :])


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character of each of the 256 bytes (GPT-2's table)."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    extra = iter(range(256, 512))
    return {chr(b if b in printable else next(extra)): b for b in range(256)}


_BYTE_OF = _byte_level_alphabet()


class TokenTexts:
    """Token strings and bytes for logprobs."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def token_bytes(self, token: int) -> bytes:
        text = self.tokenizer.decode([token], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode()
        piece = self.tokenizer.id_to_token(token) or ""
        if all(c in _BYTE_OF for c in piece):  # part of a multi-byte character
            return bytes(_BYTE_OF[c] for c in piece)
        return text.encode()

    def entry(self, token: int, logprob: float) -> dict[str, Any]:
        raw = self.token_bytes(token)
        return {"token": raw.decode(errors="replace"), "logprob": logprob, "bytes": list(raw)}

    def chat_logprobs(self, tokens: list[int], logprobs: list[dict[int, float]], top: int) -> list[dict]:
        out = []
        for token, entries in zip(tokens, logprobs, strict=True):
            best = sorted(entries.items(), key=lambda kv: -kv[1])[:top]
            out.append(
                {**self.entry(token, entries[token]), "top_logprobs": [self.entry(t, v) for t, v in best]}
            )
        return out

    def completion_logprobs(
        self, tokens: list[int], logprobs: list[dict[int, float] | None], top: int, offset: int
    ) -> dict[str, list]:
        """The legacy completions format; `offset` is where this piece starts in the choice's text. A token
        without entries (the first of an echoed prompt: nothing comes before it) has null logprobs."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entries in zip(tokens, logprobs, strict=True):
            text = self.entry(token, 0.0)["token"]
            best = sorted(entries.items(), key=lambda kv: -kv[1])[:top] if entries else []
            out["tokens"].append(text)
            out["token_logprobs"].append(entries[token] if entries else None)
            out["top_logprobs"].append({self.entry(t, 0.0)["token"]: v for t, v in best} if best else None)
            out["text_offset"].append(offset)
            offset += len(text)
        return out

    def prompt_logprobs(self, scored: list[PromptLogprob]) -> list[dict[str, dict] | None]:
        """vLLM's `prompt_logprobs` field: null for the first prompt token, then per token
        {token id: {logprob, rank, decoded_token}} for the token and the top ones."""
        return [
            None if entry is None else {str(t): dataclasses.asdict(lp) for t, lp in entry.items()}
            for entry in as_vllm(scored, self.tokenizer)
        ]
