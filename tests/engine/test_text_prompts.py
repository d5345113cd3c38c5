"""Text prompts get BOS exactly once at every entry point, whatever the tokenizer's post-processor does."""

from __future__ import annotations

import sys

import pytest
from tokenizers.processors import TemplateProcessing

from engine.llm import LLM
from engine.request import SamplingParams
from engine.server.api import OpenAIServer
from model import generate
from model.testing.tiny import write_tiny
from model.tokenizer import BOS, BOS_ID, load_tokenizer, prompt_ids

TEXTS = ["The quick brown fox", " a leading space", "<｜User｜>hi<｜Assistant｜>", "x"]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def bos_checkpoint(tmp_path_factory):
    """A tiny checkpoint whose tokenizer.json adds BOS in its post-processor, as the official ones do."""
    path = write_tiny(tmp_path_factory.mktemp("tiny-bos"))
    tokenizer = load_tokenizer(path)
    tokenizer.post_processor = TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    tokenizer.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def llm(bos_checkpoint):
    return LLM(bos_checkpoint, kv_cache_memory=32 * 2**20)


def test_prompt_ids_are_the_post_processed_encoding(bos_checkpoint):
    with_bos, plain = load_tokenizer(bos_checkpoint), load_tokenizer()
    for text in TEXTS:
        want = with_bos.encode(text).ids
        assert want[0] == BOS_ID and want.count(BOS_ID) == 1
        assert prompt_ids(with_bos, text, BOS_ID) == want == prompt_ids(plain, text, BOS_ID)
        assert prompt_ids(with_bos, text, BOS_ID, add_bos=False) == want[1:]
    # A text that already starts with BOS (a pre-rendered chat prompt) does not get a second one.
    assert prompt_ids(with_bos, BOS + TEXTS[0], BOS_ID) == with_bos.encode(TEXTS[0]).ids


def test_llm_text_prompts_get_one_bos(bos_checkpoint, llm):
    tokenizer = load_tokenizer(bos_checkpoint)
    out = llm.generate(TEXTS, GREEDY)
    assert [c.prompt_token_ids for c in out] == [tokenizer.encode(t).ids for t in TEXTS]
    by_ids = llm.generate([tokenizer.encode(t).ids for t in TEXTS], GREEDY)
    assert [c.outputs[0].token_ids for c in out] == [c.outputs[0].token_ids for c in by_ids]


def test_llm_takes_a_single_string_as_one_request(llm):
    [single] = llm.generate(TEXTS[0], GREEDY)
    [listed] = llm.generate([TEXTS[0]], GREEDY)
    assert single.prompt_token_ids == listed.prompt_token_ids
    assert single.outputs[0].token_ids == listed.outputs[0].token_ids
    [by_ids] = llm.generate(single.prompt_token_ids, GREEDY)  # a single token-id list likewise
    assert by_ids.outputs[0].token_ids == single.outputs[0].token_ids
    assert single.prompt == TEXTS[0] and single.outputs[0].text


def test_server_text_prompt_gets_one_bos(bos_checkpoint, llm):
    tokenizer = load_tokenizer(bos_checkpoint)
    server = OpenAIServer(llm.engine, ["tiny"])
    for text in TEXTS:
        assert server.text_prompt(text) == tokenizer.encode(text).ids
        assert server.text_prompt(text, add_bos=False) == tokenizer.encode(text).ids[1:]


def test_model_generate_prompt_gets_one_bos(bos_checkpoint, llm, monkeypatch, capsys):
    tokenizer = load_tokenizer(bos_checkpoint)
    text = TEXTS[0]
    monkeypatch.setattr(
        sys, "argv", ["generate", "--model", str(bos_checkpoint), "--prompt", text, "--max-tokens", "4"]
    )
    generate.main()
    want = generate.greedy(llm.engine.model, tokenizer.encode(text).ids, 4)
    assert capsys.readouterr().out == text + tokenizer.decode(want) + "\n"
