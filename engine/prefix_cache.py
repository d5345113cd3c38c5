"""Exact prefix caching: the cache blocks of full pages of P tokens, found again by chained hashes.

A page is P prompt (or output) tokens; its key hashes its parent's key, its tokens and a salt of
everything else that changes the KV (model, dtype, quantisation), so equal keys mean equal prefixes.
A page holds a reference to the compressed-group blocks its entries (main KV and index keys) live in;
those rows are never written again, so any number of requests read them. A page may also end at a
checkpoint: the window blocks of the positions the next query reads back to, and the request's dense
state there (compressor overlap rows, Engram look-back), opaque to this module. A hit needs both, so
a lookup returns the longest run of cached pages cut back to its last checkpoint.

Unreferenced pages go least recently used first, leaves before their parents (a child is unreachable
without its parent); a page some request reads (``users`` > 0) is never evicted.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from dataclasses import dataclass, field

DEFAULT_PAGE_SIZE = 256  # what vLLM and SGLang hit on


def check_page_size(page_size: int, ratios: tuple[int, ...], window: int) -> None:
    """A page boundary closes every compressor's window and lies at least a window past the last one."""
    bad = [r for r in ratios if r and page_size % r]
    if page_size < window or bad or page_size < 1:
        raise ValueError(
            f"prefix cache page size {page_size} must be a multiple of every compress ratio "
            f"{sorted(set(ratios) - {0})} and >= the sliding window {window}"
        )


def cache_salt(*parts: object) -> bytes:
    """A salt from everything besides the tokens that changes the cached KV."""
    return hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()


@dataclass(frozen=True)
class Checkpoint:
    first_block: int  # index in the window table of the first block a query at the boundary reads
    window_blocks: list[int]  # from there up to the boundary
    state: object  # the request's dense state at the boundary


@dataclass(eq=False)
class Page:
    key: bytes
    parent: Page | None
    end: int  # tokens up to the page's end: its boundary
    blocks: dict[str, list[int]]  # group -> the blocks holding the page's entries, one reference each
    checkpoint: Checkpoint | None = None
    users: int = 0  # requests whose cache reads it now
    children: int = 0
    last_used: int = 0


@dataclass(frozen=True)
class Hit:
    pages: list[Page] = field(default_factory=list)  # the run, ending at the page with the checkpoint

    @property
    def num_tokens(self) -> int:
        return self.pages[-1].end if self.pages else 0

    @property
    def checkpoint(self) -> Checkpoint | None:
        return self.pages[-1].checkpoint if self.pages else None


class PrefixCache:
    def __init__(self, page_size: int, salt: bytes):
        if page_size < 1:
            raise ValueError(f"page_size={page_size} must be positive")
        self.page_size, self.salt = page_size, salt
        self.pages: dict[bytes, Page] = {}
        self._clock = itertools.count(1)

    def keys(self, tokens: list[int]) -> list[bytes]:
        """The chained key of every full page of ``tokens``."""
        keys, parent, p = [], self.salt, self.page_size
        for start in range(0, len(tokens) - p + 1, p):
            parent = hashlib.sha256(parent + array("q", tokens[start : start + p]).tobytes()).digest()
            keys.append(parent)
        return keys

    def lookup(self, tokens: list[int]) -> Hit:
        """The longest cached run of pages of a prompt ending at a checkpoint b <= len(tokens) - 1 (at
        least one token is left to compute, for the logits)."""
        run: list[Page] = []
        for key in self.keys(tokens[: len(tokens) - 1]):
            page = self.pages.get(key)
            if page is None:
                break
            run.append(page)
        while run and run[-1].checkpoint is None:
            run.pop()
        now = next(self._clock)
        for page in run:
            page.last_used = now
        return Hit(run)

    def acquire(self, pages: list[Page]) -> None:
        for page in pages:
            page.users += 1

    def release(self, pages: list[Page]) -> None:
        for page in pages:
            page.users -= 1

    def get(self, key: bytes) -> Page | None:
        return self.pages.get(key)

    def insert(self, key: bytes, parent: Page | None, blocks: dict[str, list[int]]) -> Page:
        """A new page after ``parent``, holding ``blocks`` (the caller has taken a reference on each)."""
        if key in self.pages:
            raise ValueError("page already cached")
        end = (parent.end if parent else 0) + self.page_size
        page = Page(key, parent, end, blocks, last_used=next(self._clock))
        if parent is not None:
            parent.children += 1
        self.pages[key] = page
        return page

    def evict(self) -> list[int] | None:
        """Drop the least recently used page nobody reads and no cached page continues; the blocks it
        referenced (the caller drops one reference each), or None when every page is in use."""
        leaves = (p for p in self.pages.values() if p.users == 0 and p.children == 0)
        victim = min(leaves, key=lambda p: p.last_used, default=None)
        if victim is None:
            return None
        del self.pages[victim.key]
        if victim.parent is not None:
            victim.parent.children -= 1
        window = victim.checkpoint.window_blocks if victim.checkpoint else []
        return [b for blocks in victim.blocks.values() for b in blocks] + window

    def num_pages(self) -> int:
        return len(self.pages)
