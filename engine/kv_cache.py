"""Block accounting for the hybrid KV cache of DeepSeek V4 / V4.1.

One pool of equal-sized blocks (pages) serves every cache group; a block belongs to one group at a
time and holds as many slots of that group as fit (``block_size`` slots of the widest group).
Groups grow at their own rates: the sliding-window group covers token positions and frees blocks
once they are entirely older than ``t - W + 1``; a compressed group holds one entry per ``ratio``
tokens of every layer that compresses at that ratio (main KV and index keys). A step gets every
block it needs or none (the scheduler then preempts), so no step runs on a short buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model.cache import CacheGroup, block_layout


@dataclass
class BlockTable:
    blocks: list[int] = field(default_factory=list)  # -1 where a window block was freed
    first_live: int = 0  # blocks before this index are freed


class KVCacheManager:
    def __init__(self, groups: tuple[CacheGroup, ...], block_size: int, num_blocks: int):
        if block_size < 1 or num_blocks < 1:
            raise ValueError(f"block_size={block_size} and num_blocks={num_blocks} must be positive")
        self.groups, self.block_size, self.num_blocks = groups, block_size, num_blocks
        self.block_bytes, self.slots_per_block = block_layout(groups, block_size)
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[str, dict[str, BlockTable]] = {}  # request id -> group name -> table

    @classmethod
    def from_budget(
        cls, groups: tuple[CacheGroup, ...], block_size: int, memory_bytes: int
    ) -> KVCacheManager:
        """As many blocks as ``memory_bytes`` holds."""
        block_bytes, _ = block_layout(groups, block_size)
        if memory_bytes < block_bytes:
            raise ValueError(f"kv cache memory {memory_bytes} B is below one block ({block_bytes} B)")
        return cls(groups, block_size, memory_bytes // block_bytes)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage_ratio(self) -> float:
        """The share of blocks held (a read of one length: safe from another thread)."""
        return 1.0 - len(self.free) / self.num_blocks

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
        if self.blocks_needed(request_id, start, num_tokens) > len(self.free):
            return False
        tables = self.tables.setdefault(request_id, {g.name: BlockTable() for g in self.groups})
        for group in self.groups:
            table = tables[group.name]
            first, total = self._blocks_after(group, num_tokens, start)
            while len(table.blocks) < first:  # never held: skipped past the window
                table.blocks.append(-1)
            while len(table.blocks) < total:
                table.blocks.append(self.free.pop())
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
                    self.free.append(table.blocks[i])
                    table.blocks[i] = -1
            table.first_live = max(table.first_live, first)

    def free_request(self, request_id: str) -> None:
        for table in self.tables.pop(request_id, {}).values():
            self.free.extend(b for b in table.blocks if b >= 0)

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
