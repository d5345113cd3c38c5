"""Incremental detokenisation that never splits a multi-byte character.

Text is released only once the bytes decoded so far form complete characters: a trailing U+FFFD
(an incomplete UTF-8 sequence of a byte-level token) is held back until later tokens complete it.
"""

from __future__ import annotations

from tokenizers import Tokenizer

_INCOMPLETE = "\ufffd"
_CONTEXT = 6  # tokens decoded before the new ones so merges across the boundary render right


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # decoding starts here (a few tokens before the unreleased ones)
        self.read = 0  # tokens up to here are released as text
        self.text = ""

    def add(self, token: int) -> str:
        """Append a token; return the newly complete text (possibly empty)."""
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read], skip_special_tokens=self.skip)
        after = self.tokenizer.decode(self.ids[self.prefix :], skip_special_tokens=self.skip)
        if after.endswith(_INCOMPLETE) or len(after) <= len(before):
            return ""
        new = after[len(before) :]
        self.read = len(self.ids)
        self.prefix = max(0, self.read - _CONTEXT)
        self.text += new
        return new
