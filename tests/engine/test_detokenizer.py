"""Incremental detokenisation equals decoding the whole output and never splits a character."""

from __future__ import annotations

from engine.detokenizer import IncrementalDetokenizer
from model.tokenizer import load_tokenizer

TEXTS = ["plain ascii text", "naïve café — ünïcödé", "emoji 🙂🚀 and 漢字 mixed", "tabs\tand\nnewlines  x"]


def test_pieces_join_to_the_full_decode_and_are_whole_characters():
    tokenizer = load_tokenizer()
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        detok = IncrementalDetokenizer(tokenizer)
        pieces = [detok.add(t) for t in ids]
        assert "".join(pieces) == tokenizer.decode(ids) == text
        assert all("\ufffd" not in p for p in pieces)
    multi_byte = tokenizer.encode("🙂", add_special_tokens=False).ids
    assert len(multi_byte) > 1  # the emoji spans several byte-level tokens: the first pieces are held back
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add(t) for t in multi_byte][:-1] == [""] * (len(multi_byte) - 1)
