"""Constrained decoding: JSON schemas and forced DSML tool calls as per-step token masks (llguidance).

llguidance compiles a Lark-like grammar (with inline JSON schemas) against the tokenizer and computes each
step's allowed tokens on the CPU. It ships abi3 wheels for x86_64 and aarch64 with no Python dependencies,
so it installs next to triton-ascend; xgrammar, the other maintained engine, requires upstream `triton` on
x86_64, which would replace triton-ascend's module of the same name (docs/serving.md).
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
import torch
from tokenizers import Tokenizer

from engine.request import LogitsProcessor
from model.chat import NAME_RE
from model.chat_profile import V4_0731, ChatProfile
from model.tokenizer import DSML, THINK_END

# Compact JSON with at most one space after ':' and ',': a model can write either common style, and cannot
# fill its whole token budget with whitespace.
_JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ?", "item_separator": ", ?"}


class GrammarError(ValueError):
    """A schema or tool definition the grammar engine cannot enforce (the request gets a 400)."""


class GrammarProcessor:
    """Masks every token the grammar does not allow next; one instance per sequence (it keeps state)."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_id: int):
        self.matcher, self.eos_id, self.consumed = matcher, eos_id, 0

    def __call__(self, output: list[int], logits: torch.Tensor) -> torch.Tensor:
        if len(output) > self.consumed:
            self.matcher.consume_tokens(output[self.consumed :])
            self.consumed = len(output)
        bias = torch.frombuffer(bytearray(self.matcher.compute_logit_bias()), dtype=torch.uint8)
        allowed = torch.zeros(logits.shape[0], dtype=torch.bool)
        n = min(bias.shape[0], logits.shape[0])
        allowed[:n] = bias[:n] > 0
        if not allowed.any():  # only in the matcher's error state: end the sequence rather than sample noise
            allowed[self.eos_id] = True
        return logits.masked_fill(~allowed, float("-inf"))


class LogitBias:
    """OpenAI `logit_bias`: a constant added to the listed tokens' logits."""

    def __init__(self, bias: dict[int, float]):
        self.ids = torch.tensor(list(bias), dtype=torch.long)
        self.values = torch.tensor(list(bias.values()), dtype=torch.float32)

    def __call__(self, output: list[int], logits: torch.Tensor) -> torch.Tensor:
        return logits.index_add(0, self.ids, self.values.to(logits.dtype))


class ThinkingBudget:
    """Closes the reasoning after `budget` output tokens: until `</think>` is written, it is then the only
    token allowed, and the answer follows. It reads the output alone, so a replay after preemption
    decides the same."""

    def __init__(self, budget: int, think_end: int):
        self.budget, self.think_end = budget, think_end

    def __call__(self, output: list[int], logits: torch.Tensor) -> torch.Tensor:
        if len(output) < self.budget or self.think_end in output:
            return logits
        forced = torch.full_like(logits, float("-inf"))
        forced[self.think_end] = logits[self.think_end]
        return forced


def chain(*processors: LogitsProcessor | None) -> LogitsProcessor | None:
    present = [p for p in processors if p is not None]
    if len(present) <= 1:
        return present[0] if present else None

    def apply(output: list[int], logits: torch.Tensor) -> torch.Tensor:
        for processor in present:
            logits = processor(output, logits)
        return logits

    return apply


def _quote(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


class Grammars:
    """Grammars over one tokenizer: JSON output and forced tool calls, optionally after the reasoning."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_id: int):
        self.tokenizer, self.eos_id = tokenizer, eos_id
        n_vocab = max(vocab_size, tokenizer.get_vocab_size())
        self.lltok = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=n_vocab, eos_token=eos_id)

    def _lit(self, text: str) -> str:
        """A protocol string: a token reference where the engine treats it as a special token."""
        token = self.tokenizer.token_to_id(text)
        if token is not None and self.lltok.is_special_token(token):
            return f"<[{token}]>"
        return _quote(text)

    def _free_text_until(self, marker: str) -> str:
        """A terminal for any text that does not contain `marker` (which may then follow)."""
        escaped = json.dumps(marker, ensure_ascii=False)[1:-1].replace("/", "\\/")
        return f"/(?s:.*)/ & ~/(?s:.*){escaped}(?s:.*)/"

    def _text_then(self, marker: str) -> tuple[str, str]:
        """A terminal for text up to `marker`, and what the rule writes after it.

        A marker that is plain text (V4.1's tags are not tokens) ends the same terminal: llguidance's lexer
        is greedy and would otherwise take the marker's first bytes as text and then fail.
        """
        lit = self._lit(marker)
        if lit.startswith("<["):
            return self._free_text_until(marker), lit
        escaped = json.dumps(marker, ensure_ascii=False)[1:-1].replace("/", "\\/")
        return f"/(?s:.*){escaped}/ & ~/(?s:.*){escaped}(?s:.+)/", ""

    def _wrap(self, body: str, thinking: bool, rules: list[str]) -> str:
        """The grammar text: in thinking mode the constraint starts after `</think>`."""
        if not thinking:
            return "\n".join([f"start: {body}", *rules])
        reasoning = f"REASONING: {self._free_text_until(THINK_END)}"
        return "\n".join([f"start: REASONING {self._lit(THINK_END)} {body}", reasoning, *rules])

    @staticmethod
    def _json(schema: Any) -> str:
        if not isinstance(schema, dict):
            raise GrammarError("the JSON schema must be an object")
        return "%json " + json.dumps({**schema, "x-guidance": _JSON_STYLE}, ensure_ascii=False)

    def json(self, schema: dict[str, Any], thinking: bool) -> str:
        return self._wrap("value", thinking, [f"value: {self._json(schema)}"])

    def tool_calls(
        self,
        tools: list[dict[str, Any]],
        only: str | None,
        thinking: bool,
        parallel: bool,
        profile: ChatProfile = V4_0731,
    ) -> str:
        """Exactly the DSML block model/chat.py renders in `profile`, calling `only` (once) or any of `tools`.

        Required parameters are generated in schema order and optional ones left out. Unconstrained string
        parameters are written raw (string="true", as the model was trained); every other parameter as JSON
        enforced by its schema (string="false", which the parser reads the same way).
        """
        invoke_tag, param_tag, calls_tag = profile.invoke_tag, profile.parameter_tag, profile.calls_tag
        rules, invokes = [], []
        for k, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(fn, dict) or (only is not None and fn.get("name") != only):
                continue
            params = fn.get("parameters") or {}
            props = params.get("properties", {}) if isinstance(params, dict) else None
            required = params.get("required", []) if isinstance(params, dict) else None
            if not isinstance(props, dict) or not isinstance(required, list):
                raise GrammarError(f"tools[{k}].function.parameters must be an object schema")
            parts = []
            for j, key in enumerate(required):
                if not isinstance(key, str) or not NAME_RE.fullmatch(key):
                    raise GrammarError(f"tools[{k}]: parameter name {key!r} cannot be written as a tool call")
                schema = props.get(key, {})
                raw = isinstance(schema, dict) and set(schema) <= {"type", "description", "title"}
                raw = raw and schema.get("type") == "string"
                head = f'<{DSML}{param_tag} name="{key}" string="{"true" if raw else "false"}">'
                end = f"</{DSML}{param_tag}>"
                if raw:
                    text, close = self._text_then(end)
                    rules.append(f"RAW_{k}_{j}: {text}")
                    value = f"RAW_{k}_{j} {close}"
                else:
                    rules.append(f"json_{k}_{j}: {self._json(schema)}")
                    value = f"json_{k}_{j} {self._lit(end)}"
                parts.append(f"{_quote(head)} {value}")
            body = ' "\\n" '.join(parts) if parts else '""'
            head = _quote(f'<{DSML}{invoke_tag} name="{fn.get("name")}">\n')
            rules.append(f'invoke_{k}: {head} {body} "\\n" {self._lit(f"</{DSML}{invoke_tag}>")}')
            invokes.append(f"invoke_{k}")
        if not invokes:
            raise GrammarError(f"no tool named {only!r}" if only else "tools must not be empty")
        repeat = '("\\n" invoke)*' if parallel and only is None else ""
        block = (
            f'"\\n\\n" {self._lit(f"<{DSML}{calls_tag}>")} "\\n" invoke {repeat} "\\n" '
            f"{self._lit(f'</{DSML}{calls_tag}>')}"
        )
        return self._wrap(block, thinking, [f"invoke: {' | '.join(invokes)}", *rules])

    def compile(self, grammar: str) -> llguidance.LLMatcher:
        error = llguidance.LLMatcher.validate_grammar(grammar, self.lltok)
        if error:
            raise GrammarError(f"cannot enforce this format: {error}")
        return llguidance.LLMatcher(self.lltok, grammar, log_level=0)

    def processors(self, grammar: str, n: int) -> list[GrammarProcessor]:
        """One processor per sequence: the grammar is compiled once and its matcher copied."""
        matcher = self.compile(grammar)
        return [GrammarProcessor(matcher if i == 0 else matcher.deep_copy(), self.eos_id) for i in range(n)]
