"""Block accounting for the hybrid KV cache of DeepSeek V4 / V4.1.

One pool of equal-sized blocks (pages) serves every cache group; a block belongs to one group at a
time and holds as many slots of that group as fit (``block_size`` slots of the widest group).
Groups grow at their own rates: the sliding-window group covers token positions and frees blocks
once they are entirely older than ``t - W + 1``; a compressed group holds one entry per ``ratio``
tokens of every layer that compresses at that ratio (main KV and index keys). A step gets every
block it needs or none (the scheduler then preempts), so no step runs on a short buffer.

With a prefix cache, blocks are reference-counted: full pages keep their compressed blocks and
checkpoints their window blocks after the request that wrote them is gone, and a request that hits
shares them read-only. Where the boundary falls inside a block, the hitting request gets a copy of
that block instead (``take_copies``: the runner copies it before the step), so no write of one
request ever lands in a block another reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.prefix_cache import Checkpoint, Hit, Page, PrefixCache, cache_salt, check_page_size
from model.cache import CacheGroup, CacheLayout, check_kv_cache_device
from model.causal_lm import CausalLM


@dataclass
class BlockTable:
    blocks: list[int] = field(default_factory=list)  # -1 where a window block was freed
    first_live: int = 0  # blocks before this index are freed


class KVCacheManager:
    def __init__(self, layout: CacheLayout, num_blocks: int, prefix: PrefixCache | None = None):
        """``layout``: how a block splits into every group's slots; the pools view the blocks with it too."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be positive")
        self.layout = layout
        self.groups, self.block_size, self.num_blocks = layout.groups, layout.block_size, num_blocks
        self.block_bytes, self.slots_per_block = self.layout.block_bytes, self.layout.slots_per_block
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[str, dict[str, BlockTable]] = {}  # request id -> group name -> table
        self.prefix = prefix
        self.refs = [0] * num_blocks  # holders of each block: request tables and cached pages
        self.request_refs = [0] * num_blocks
        self.num_request_blocks = 0  # blocks some request's table holds
        self.hits: dict[str, list[Page]] = {}  # request id -> the cached pages it reads
        self.copies: dict[int, int] = {}  # block to fill before the next step -> the block to copy
        self.resumes: dict[str, object] = {}  # request id -> the checkpoint state it continues from

    @classmethod
    def from_budget(
        cls, layout: CacheLayout, memory_bytes: int, prefix: PrefixCache | None = None
    ) -> KVCacheManager:
        """As many blocks as ``memory_bytes`` holds."""
        if memory_bytes < layout.block_bytes:
            raise ValueError(f"kv cache memory {memory_bytes} B is below one block ({layout.block_bytes} B)")
        return cls(layout, memory_bytes // layout.block_bytes, prefix)

    @classmethod
    def for_model(cls, model: CausalLM, config: EngineConfig, prefix: bool = True) -> KVCacheManager:
        """The cache ``config`` sizes for ``model``'s groups; ``prefix``: with the prefix cache ``config``
        asks for (a tensor-parallel worker's cache mirrors rank 0's tables, so it keeps none)."""
        weight = model.embed.weight
        check_kv_cache_device(config.kv_cache_dtype, weight.device)
        layout = CacheLayout.for_model(model.cfg, weight.dtype, config.block_size, config.kv_cache_dtype)
        prefix_cache = _prefix_cache(model, config) if prefix else None
        return cls.from_budget(layout, config.kv_cache_memory, prefix_cache)

    @property
    def num_free(self) -> int:
        """Blocks no request holds (some may still keep cached pages, given up under pressure)."""
        return self.num_blocks - self.num_request_blocks

    def usage_ratio(self) -> float:
        """The share of blocks requests hold (a read of one int: safe from another thread)."""
        return self.num_request_blocks / self.num_blocks

    def _take(self) -> int:
        block = self.free.pop()
        self._share(block, by_request=True)
        return block

    def _share(self, block: int, by_request: bool) -> None:
        self.refs[block] += 1
        if by_request:
            self.request_refs[block] += 1
            self.num_request_blocks += self.request_refs[block] == 1

    def _drop(self, block: int, by_request: bool) -> None:
        if by_request:
            self.request_refs[block] -= 1
            self.num_request_blocks -= self.request_refs[block] == 0
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free.append(block)

    def _reclaim(self, need: int) -> bool:
        """Evict unused cached pages until ``need`` blocks are free; whether they are."""
        while len(self.free) < need and self.prefix is not None:
            blocks = self.prefix.evict()
            if blocks is None:
                break
            for block in blocks:
                self._drop(block, by_request=False)
        return len(self.free) >= need

    def usage(self) -> dict[str, int]:
        """Blocks held per group."""
        held = {g.name: 0 for g in self.groups}
        for tables in self.tables.values():
            for name, table in tables.items():
                held[name] += sum(1 for b in table.blocks if b >= 0)
        return held

    def _blocks_after(self, group: CacheGroup, num_tokens: int, start: int) -> tuple[int, int]:
        """(first block still needed, number of blocks spanned) once ``num_tokens`` are cached,
        for a step whose first new token is at ``start``."""
        per_block = self.slots_per_block[group.name]
        total = -(-group.slots_needed(num_tokens) // per_block)
        if group.window is None:
            return 0, total
        oldest = max(0, start - group.window + 1)  # the step's first query still reads from here
        return oldest // per_block, total

    def blocks_needed(self, request_id: str, start: int, num_tokens: int) -> int:
        """New blocks a step that brings the request to ``num_tokens`` cached tokens must allocate."""
        tables = self.tables.get(request_id, {})
        need = 0
        for group in self.groups:
            table = tables.get(group.name, BlockTable())
            first, total = self._blocks_after(group, num_tokens, start)
            need += max(0, total - max(len(table.blocks), first))
        return need

    def allocate(self, request_id: str, start: int, num_tokens: int) -> bool:
        """All the blocks for the step, or nothing (returns False)."""
        if not self._reclaim(self.blocks_needed(request_id, start, num_tokens)):
            return False
        tables = self.tables.setdefault(request_id, {g.name: BlockTable() for g in self.groups})
        for group in self.groups:
            table = tables[group.name]
            first, total = self._blocks_after(group, num_tokens, start)
            while len(table.blocks) < first:  # never held: skipped past the window
                table.blocks.append(-1)
            while len(table.blocks) < total:
                table.blocks.append(self._take())
        return True

    def release_old(self, request_id: str, num_tokens: int) -> None:
        """After a step: give back window blocks no later query can read."""
        for group in self.groups:
            if group.window is None:
                continue
            table = self.tables[request_id][group.name]
            first, _ = self._blocks_after(group, num_tokens, num_tokens)
            for i in range(table.first_live, min(first, len(table.blocks))):
                if table.blocks[i] >= 0:
                    self._drop(table.blocks[i], by_request=True)
                    table.blocks[i] = -1
            table.first_live = max(table.first_live, first)

    def free_request(self, request_id: str) -> None:
        for table in self.tables.pop(request_id, {}).values():
            for block in table.blocks:
                if block >= 0:
                    self.copies.pop(block, None)  # a copy it never got to read
                    self._drop(block, by_request=True)
        if self.prefix is not None:
            self.prefix.release(self.hits.pop(request_id, []))
        self.resumes.pop(request_id, None)

    def _span(self, group: CacheGroup, start: int, end: int) -> range:
        """Indices in the group's table of the blocks holding tokens ``[start, end)`` (their entries)."""
        per_block = self.slots_per_block[group.name]
        first, last = group.slots_needed(start), group.slots_needed(end)
        return range(first // per_block, -(-last // per_block)) if last > first else range(0)

    def _window_start(self, group: CacheGroup, boundary: int) -> int:
        """The oldest position a query at ``boundary`` reads."""
        return max(0, boundary - (group.window or 0) + 1)

    def attach_prefix(self, request_id: str, tokens: list[int]) -> int:
        """Start a new request's tables from the longest cached prefix of ``tokens``; the tokens hit (the
        request computes from there), 0 on a miss or when the copies it needs find no free block."""
        if self.prefix is None or request_id in self.tables:
            return 0
        hit = self.prefix.lookup(tokens)
        if not hit.pages:
            return 0
        self.prefix.acquire(hit.pages)
        self.hits[request_id] = hit.pages
        tables = self.tables[request_id] = self._shared_tables(hit)
        boundary = hit.num_tokens
        partial = [g for g in self.groups if g.slots_needed(boundary) % self.slots_per_block[g.name]]
        if not self._reclaim(len(partial)):
            self.free_request(request_id)
            return 0
        for group in partial:  # the request writes past the boundary in this block: its own copy
            blocks = tables[group.name].blocks
            source, blocks[-1] = blocks[-1], self._take()
            self.copies[blocks[-1]] = source
            self._drop(source, by_request=True)
        self.resumes[request_id] = hit.pages[-1].checkpoint.state
        return boundary

    def _shared_tables(self, hit: Hit) -> dict[str, BlockTable]:
        """Tables reading the hit's blocks: each block index from the last page that holds it (a later
        page's block is a copy of the earlier one below its own start, so it holds both pages' rows)."""
        checkpoint = hit.checkpoint
        assert checkpoint is not None
        tables = {}
        for group in self.groups:
            if group.window is not None:
                blocks = [-1] * checkpoint.first_block + checkpoint.window_blocks
                tables[group.name] = BlockTable(blocks, checkpoint.first_block)
                continue
            at: dict[int, int] = {}
            for page in hit.pages:
                span = self._span(group, page.end - self.prefix.page_size, page.end)
                at.update(zip(span, page.blocks[group.name], strict=True))
            tables[group.name] = BlockTable([at[i] for i in range(len(at))])
        for table in tables.values():
            for block in table.blocks:
                if block >= 0:
                    self._share(block, by_request=True)
        return tables

    def take_copies(self) -> list[tuple[int, int]]:
        """(source, destination) blocks to copy before the next step runs."""
        copies, self.copies = [(src, dst) for dst, src in self.copies.items()], {}
        return copies

    def take_resumes(self) -> dict[str, object]:
        """Requests admitted on a hit since the last call, and the checkpoint state each continues from."""
        resumes, self.resumes = self.resumes, {}
        return resumes

    def register(self, request_id: str, tokens: list[int], state: object) -> None:
        """Cache every full page of ``tokens`` (the request's computed tokens, ending on a page boundary)
        and a checkpoint at their end holding the request's window blocks and dense ``state`` there."""
        prefix, tables = self.prefix, self.tables[request_id]
        if prefix is None or not tokens or len(tokens) % prefix.page_size:
            raise ValueError(f"{len(tokens)} tokens: a checkpoint lies on a page boundary")
        parent = None
        for key in prefix.keys(tokens):
            page = prefix.get(key)
            if page is None:
                end = (parent.end if parent else 0) + prefix.page_size
                blocks = {
                    g.name: [tables[g.name].blocks[i] for i in self._span(g, end - prefix.page_size, end)]
                    for g in self.groups
                    if g.window is None
                }
                for held in blocks.values():
                    for block in held:
                        self._share(block, by_request=False)
                page = prefix.insert(key, parent, blocks)
            parent = page
        if parent is None or parent.checkpoint is not None:
            return
        window = next(g for g in self.groups if g.window is not None)
        span = self._span(window, self._window_start(window, len(tokens)), len(tokens))
        blocks = [tables[window.name].blocks[i] for i in span]
        if min(blocks, default=0) < 0:
            raise ValueError("the window before the checkpoint was already released")
        for block in blocks:
            self._share(block, by_request=False)
        parent.checkpoint = Checkpoint(span.start, blocks, state)

    def max_blocks(self, num_tokens: int, max_chunk: int) -> int:
        """Most blocks a request of ``num_tokens`` holds at once, computed in chunks of ``max_chunk``."""
        peak = 0
        for group in self.groups:
            per_block = self.slots_per_block[group.name]
            if group.window is None:
                peak += -(-group.slots_needed(num_tokens) // per_block)
            else:  # a chunk's queries read back W-1 positions; the span may straddle one more block
                span = min(num_tokens, max_chunk + group.window - 1)
                peak += -(-span // per_block) + 1
        return peak


def _prefix_cache(model: CausalLM, config: EngineConfig) -> PrefixCache | None:
    if not config.prefix_caching:
        return None
    cfg = model.cfg
    check_page_size(config.prefix_page_size, tuple(cfg.compress_ratios), cfg.sliding_window)
    dtypes = sorted({str(p.dtype) for p in model.parameters()})  # int8 where requantised
    return PrefixCache(config.prefix_page_size, cache_salt(repr(cfg), *dtypes))
