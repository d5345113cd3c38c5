import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model.tokenizer import (
    CORPUS_PATH,
    NOISE,
    NOISE_TOKEN_ID,
    SPECIAL_TOKENS,
    TOKEN_IDS,
    VOCAB_SIZE,
    TextTokenizer,
    build_tokenizer,
    load_tokenizer,
    main,
    write_tokenizer,
)

# Spelled out here rather than imported, so a typo in the module's constants cannot pass unnoticed.
SPECIAL = [
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜▁pad▁｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜latest_reminder｜>",
    "<｜action｜>",
    "<｜query｜>",
    "<｜authority｜>",
    "<｜domain｜>",
    "<｜title｜>",
    "<｜read_url｜>",
    "<｜noise｜>",
]
KEPT = [
    "<think>",
    "</think>",
    "｜DSML｜",
    "<｜DSML｜tool_calls>",
    "</｜DSML｜tool_calls>",
    "<｜DSML｜invoke",
    "</｜DSML｜invoke>",
    "<｜DSML｜parameter",
    "</｜DSML｜parameter>",
    "<tool_result>",
    "</tool_result>",
]
TOOL_CALL = (
    'Let me check.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">[1, 2]</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>"
)
TEXTS = [
    "",
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Ünïcödé: café, naïve, Straße, Zażółć gęślą jaźń, Москва, Ελληνικά, 東京の天気, 한국어, עברית, العربية",
    "emoji 👍🏽 👩‍💻 🇯🇵 ❤️ 🫠 and combining e\u0301 a\u0308\u0323",
    "   leading, trailing   \t\t tabs \n\n\n newlines \r\n crlf \u00a0nbsp \u3000 ideographic space   ",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\n\tif (a && b) { return *p; }\n",
    "3.14159 -42 1e-6 0x1F 123456789012345678901234567890 2024-06-15T12:00:00Z",
    "control \x00\x01\x7f\x1b[0m and byte-level look-alikes Ġ Ċ ĉ Ā ÿ ▁ ｜ <｜ ｜> <｜User <｜DSML｜invoke>",
    "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>hmm</think>Hello!<｜end▁of▁sentence｜>",
    '<｜User｜><tool_result>{"temp": 21}</tool_result>\n\n<tool_result>ok</tool_result>'
    "<｜Assistant｜></think>",
    TOOL_CALL,
]


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return TextTokenizer.load()


def test_vocab_layout(tok: TextTokenizer):
    backend = tok.backend
    assert tok.vocab_size == backend.get_vocab_size() == VOCAB_SIZE == 4096
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    assert [backend.token_to_id(t) for t in SPECIAL[:3]] == [0, 1, 2]
    assert set(SPECIAL + KEPT) <= set(TOKEN_IDS)
    for token, i in TOKEN_IDS.items():
        assert backend.token_to_id(token) == i and backend.id_to_token(i) == token
    assert NOISE == "<｜noise｜>" and backend.token_to_id(NOISE) == NOISE_TOKEN_ID
    assert set(SPECIAL) <= SPECIAL_TOKENS and not SPECIAL_TOKENS & set(KEPT)
    assert sorted(TOKEN_IDS.values()) == [0, 1, 2, *range(VOCAB_SIZE - 32, VOCAB_SIZE)]


@pytest.mark.parametrize("token", SPECIAL + KEPT)
def test_chat_string_is_one_token(tok: TextTokenizer, token: str):
    i = TOKEN_IDS[token]
    assert tok.encode(token) == [i]
    ids = tok.encode(f"abc {token}def\n{token}{token}")
    assert ids.count(i) == 3 and tok.decode(ids) == f"abc {token}def\n{token}{token}"
    assert tok.decode([i]) == token


def test_tool_call_tags_tokenize_consistently(tok: TextTokenizer):
    ids = tok.encode(TOOL_CALL)
    for tag, count in [
        ("<｜DSML｜tool_calls>", 1),
        ("<｜DSML｜invoke", 1),
        ("<｜DSML｜parameter", 2),
        ("</｜DSML｜parameter>", 2),
        ("</｜DSML｜invoke>", 1),
        ("</｜DSML｜tool_calls>", 1),
    ]:
        assert ids.count(TOKEN_IDS[tag]) == count, tag
    # The parser's detection prefix and any other use of the marker share the bare marker's id.
    for text in ["\n\n<｜DSML｜tool_calls", "<｜DSML｜function_calls>", "x｜DSML｜y"]:
        assert TOKEN_IDS["｜DSML｜"] in tok.encode(text)


def test_skip_special_tokens_keeps_parser_tokens(tok: TextTokenizer):
    text = "".join(SPECIAL) + "a" + "".join(KEPT) + "b"
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == "a" + "".join(KEPT) + "b"


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: TextTokenizer, text: str):
    assert tok.decode(tok.encode(text)) == text


def test_round_trip_corpus(tok: TextTokenizer):
    text = CORPUS_PATH.read_text(encoding="utf-8")
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(ids) < len(text.encode()) / 2


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_round_trip_random(tok: TextTokenizer, text: str):
    assert tok.decode(tok.encode(text)) == text


def test_encode_add_bos(tok: TextTokenizer):
    assert tok.encode("hi", add_bos=True) == [0, *tok.encode("hi")]


@pytest.mark.parametrize(
    "bad, message",
    [
        (-1, "token id -1 at position 1 is outside [0, 4096)"),
        (4096, "token id 4096 at position 1 is outside [0, 4096)"),
        (2**40, f"token id {2**40} at position 1 is outside [0, 4096)"),
        (1.0, "token id 1.0 at position 1 is not an integer"),
        ("7", "token id '7' at position 1 is not an integer"),
    ],
)
def test_decode_rejects_bad_ids(tok: TextTokenizer, bad: object, message: str):
    with pytest.raises(ValueError) as err:
        tok.decode([5, bad, 6])
    assert str(err.value) == message


def test_decode_accepts_integer_like(tok: TextTokenizer):
    ids = tok.encode("numpy ids")
    assert tok.decode(np.array(ids, dtype=np.int64)) == tok.decode(tuple(ids)) == "numpy ids"


def test_rebuild_matches_shipped_asset():
    assert build_tokenizer().to_str() == load_tokenizer().to_str()
    assert main([]) == 0


def test_corpus_has_no_added_tokens():
    # Training does not split added tokens out, so they must not leak into the merges via the corpus.
    text = CORPUS_PATH.read_text(encoding="utf-8")
    assert not [t for t in TOKEN_IDS if t in text] and "｜" not in text


def test_build_rejects_short_corpus(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("far too short to give 3805 merges", encoding="utf-8")
    with pytest.raises(ValueError, match="needs exactly 4096"):
        build_tokenizer(corpus)


def test_load_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer file"):
        load_tokenizer(tmp_path)


def test_write_tokenizer(tmp_path, tok: TextTokenizer):
    write_tokenizer(tmp_path / "ckpt")
    assert load_tokenizer(tmp_path / "ckpt").to_str() == tok.backend.to_str()
    config = json.loads((tmp_path / "ckpt" / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == tuple(SPECIAL[:3])
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "ckpt")
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, len(hf)) == (0, 1, 2, 4096)
    for text in TEXTS:
        assert hf.encode(text) == tok.encode(text)
        assert hf.decode(tok.encode(text), skip_special_tokens=True) == tok.decode(
            tok.encode(text), skip_special_tokens=True
        )
