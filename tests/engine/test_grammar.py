"""Constrained decoding: the grammars accept exactly what the chat encoding and parser speak."""

from __future__ import annotations

import json

import pytest
import torch

from engine.grammar import GrammarError, Grammars, LogitBias, chain
from model.chat import encode_messages
from model.chat_parse import parse_completion
from model.chat_profile import PROFILES
from model.tokenizer import EOS, EOS_ID, THINK_END, load_tokenizer

TOKENIZER = load_tokenizer()
VOCAB = TOKENIZER.get_vocab_size()
GRAMMARS = Grammars(TOKENIZER, VOCAB, EOS_ID)
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
            "required": ["city", "days"],
        },
    },
}


def walk(grammar: str, text: str) -> torch.Tensor:
    """Feed `text`'s tokens one by one, each of which must be allowed; return the mask after the last."""
    processor = GRAMMARS.processors(grammar, 1)[0]
    out: list[int] = []
    for token in TOKENIZER.encode(text, add_special_tokens=False).ids:
        allowed = processor(out, torch.zeros(VOCAB)) > float("-inf")
        assert allowed[token], f"{TOKENIZER.decode(out + [token], skip_special_tokens=False)!r} is rejected"
        out.append(token)
    return processor(out, torch.zeros(VOCAB)) > float("-inf")


def test_json_schema_after_the_reasoning():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    done = walk(GRAMMARS.json(schema, thinking=True), f"Let me think.{THINK_END}" + '{"a": 12}')
    assert done.nonzero().flatten().tolist() == [EOS_ID]
    processor = GRAMMARS.processors(GRAMMARS.json(schema, thinking=False), 1)[0]
    first = processor([], torch.zeros(VOCAB)) > float("-inf")
    # The grammar forces `{"a":`, which llguidance lets through only as its canonical tokens.
    assert first.nonzero().flatten().tolist() == TOKENIZER.encode('{"a":').ids[:1]


@pytest.mark.parametrize("profile", PROFILES.values(), ids=PROFILES)
def test_forced_tool_call_is_the_encoders_block_and_parses(profile):
    call = {
        "id": "c",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 3}'},
    }
    convo = [{"role": "user", "content": "?"}, {"role": "assistant", "tool_calls": [call]}]
    prompt = encode_messages(convo, tools=[TOOL], profile=profile)
    block = prompt[prompt.rindex(profile.tool_calls_prefix) : prompt.rindex(EOS)]
    grammar = GRAMMARS.tool_calls([TOOL], "get_weather", thinking=False, parallel=True, profile=profile)
    done = walk(grammar, block)
    assert done.nonzero().flatten().tolist() == [EOS_ID]
    (parsed,) = parse_completion(block, thinking=False, profile=profile).tool_calls
    assert json.loads(parsed.arguments) == {"city": "Oslo", "days": 3}


def test_constrained_parameters_are_json_and_bad_tools_are_rejected():
    tool = json.loads(json.dumps(TOOL))
    tool["function"]["parameters"]["properties"]["city"]["enum"] = ["Oslo", "Lima"]
    grammar = GRAMMARS.tool_calls([tool], None, thinking=False, parallel=False)
    assert 'string=\\"false\\">" json_0_0' in grammar and "%json" in grammar
    with pytest.raises(GrammarError, match="no tool named"):
        GRAMMARS.tool_calls([TOOL], "nope", thinking=False, parallel=True)
    with pytest.raises(GrammarError):
        GRAMMARS.compile(GRAMMARS.json({"type": "string", "format": "no-such-format"}, thinking=False))


def test_logit_bias_and_chain():
    bias = LogitBias({3: 5.0, 7: -100.0})
    both = chain(bias, lambda out, logits: logits * 2)
    logits = both([], torch.zeros(10))
    assert logits[3] == 10.0 and logits[7] == -200.0 and logits[0] == 0.0
    assert chain(None, None) is None and chain(bias, None) is bias
