"""Where the model keeps its KV between calls: flat paged pools addressed by global slot ids.

Each layer's window keys and each compressing layer's entries (and index keys) live in pools
``[num_slots, dim]``. The pools are views over one buffer of equal-sized blocks; a block belongs
to one cache group at a time and splits evenly into (padded) slots of that group. A request maps token
positions (window group) or entry numbers (one compressed group per ratio) to slots through its
block tables: slot = block * slots_per_block + offset. The engine's ``KVCacheManager`` hands out
the blocks; a model used alone (``new_state``) gets a private store that grows on demand, so both
run the same code. Small per-request state (compressor buffers, Engram look-back) stays dense.

``kv_cache_dtype`` says how a slot holds a row: ``auto`` in the compute dtype; ``int8`` / ``fp8``
(model-spec §9.4) the NoPE channels of the window keys and compressed entries as int8 / E4M3 codes with
one fp32 scale per slot, their RoPE channels in the compute dtype, and the index keys as int8 codes with
a scale (int8 in both quantised modes). ``row_formats`` is the one description of a slot's bytes: the
group sizes, and the pools' views, are made from it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from math import gcd, isqrt
from typing import Any

import torch
import torch.nn.functional as F

from model.compressor import CompressorState
from model.config import ModelConfig
from model.plan import Attention, build_plan
from triton_kernels.compressor import CompressBatch, CompressorStates, closing_first
from triton_kernels.custom_ops import block_slots, store_quantized, store_rows
from triton_kernels.indexer import KeyPool
from triton_kernels.kv_store import QuantizedRows
from triton_kernels.sparse_attn import KVPool

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
CODE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
SCALE_BYTES = 4  # one fp32 scale per quantised row


@dataclass(frozen=True)
class CacheGroup:
    name: str
    ratio: int  # tokens per slot: 1 for the window, the compress ratio otherwise
    bytes_per_slot: int  # over every layer in the group
    window: int | None = None  # sliding: positions older than the last ``window`` are never read again
    kv_cache_dtype: str = "auto"  # how its rows are stored (``row_formats``)

    def slots_needed(self, num_tokens: int) -> int:
        return num_tokens // self.ratio


@dataclass(frozen=True)
class RowFormat:
    """One layer's row of one kind (``kind``: window, entries or index_keys) in a slot of ``group``: its
    ``width`` channels in the compute dtype, or quantised: an fp32 scale, the last ``rope`` channels in the
    compute dtype, then the codes of the others, padded to the scale's alignment."""

    kind: str
    layer: int
    group: str
    width: int
    rope: int
    dtype_bytes: int
    codes: torch.dtype | None  # None: the compute dtype

    @property
    def nbytes(self) -> int:
        if self.codes is None:
            return self.width * self.dtype_bytes
        size = SCALE_BYTES + self.rope * self.dtype_bytes + self.width - self.rope
        return -(-size // SCALE_BYTES) * SCALE_BYTES


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} must be one of {KV_CACHE_DTYPES}")


def check_kv_cache_device(kv_cache_dtype: str, device: torch.device | str) -> None:
    """FP8 codes need a device with E4M3 (CUDA) or the CPU, whose torch conversions are the exact format;
    Ascend A2/A3 have no FP8: int8 there. ``device``: a device or its type (``npu``)."""
    check_kv_cache_dtype(kv_cache_dtype)
    kind = device if isinstance(device, str) else device.type
    if kv_cache_dtype == "fp8" and kind not in ("cuda", "cpu"):
        raise ValueError(
            f"kv_cache_dtype='fp8': the {kind} device has no FP8 (E4M3) support; use 'int8' or 'auto'"
        )


def row_formats(cfg: ModelConfig, dtype_bytes: int, kv_cache_dtype: str = "auto") -> tuple[RowFormat, ...]:
    """Every layer's rows, in their order within a slot of their group: the window keys of every layer
    (draft layers included), and each compressing layer's entries, then its index keys where it has an
    indexer, in the group of its ratio."""
    check_kv_cache_dtype(kv_cache_dtype)
    codes = CODE_DTYPES.get(kv_cache_dtype)
    index_codes = None if codes is None else torch.int8  # index keys are int8 in every quantised mode
    rope = cfg.qk_rope_head_dim
    formats = []
    for p in build_plan(cfg):
        formats.append(RowFormat("window", p.index, "window", cfg.head_dim, rope, dtype_bytes, codes))
        if p.has_compressor:
            name = group_name(p.compress_ratio)
            formats.append(RowFormat("entries", p.index, name, cfg.head_dim, rope, dtype_bytes, codes))
            if p.has_indexer:
                keys = RowFormat("index_keys", p.index, name, cfg.index_head_dim, 0, dtype_bytes, index_codes)
                formats.append(keys)
    return tuple(formats)


def cache_groups(cfg: ModelConfig, dtype_bytes: int, kv_cache_dtype: str = "auto") -> tuple[CacheGroup, ...]:
    """The window group of every layer (draft layers included), and one compressed group per ratio of
    the compressing layers (their entries, plus index keys where the layer has an indexer)."""
    sizes: dict[str, int] = {}
    for row in row_formats(cfg, dtype_bytes, kv_cache_dtype):
        sizes[row.group] = sizes.get(row.group, 0) + row.nbytes
    window = CacheGroup("window", 1, sizes.pop("window"), cfg.sliding_window, kv_cache_dtype)
    by_ratio = sorted((int(name.removeprefix("compressed_r")), b) for name, b in sizes.items())
    return (window, *(CacheGroup(group_name(r), r, b, None, kv_cache_dtype) for r, b in by_ratio))


def block_layout(groups: tuple[CacheGroup, ...], block_size: int) -> tuple[int, dict[str, int]]:
    """Bytes per block and each group's slots per block.

    A block splits evenly into rows of every group, each row a slot padded up to a divisor of the block,
    so that every pool is a plain strided view of the buffer (slot = block * slots_per_block + offset).
    The block holds ``block_size`` slots of the widest group, each padded by a little (up to an eighth)
    where that lets the group that pads most pad less."""
    unit = gcd(*(g.bytes_per_slot for g in groups))  # rows stay multiples of every element size
    widest = max(g.bytes_per_slot for g in groups) // unit

    def fit(units: int) -> dict[str, int]:
        divisors = [d for d in range(1, isqrt(units) + 1) if units % d == 0]
        divisors += [units // d for d in divisors]
        return {g.name: max(d for d in divisors if d * g.bytes_per_slot <= units * unit) for g in groups}

    def padding(units: int) -> float:
        fits = fit(units)
        return max(1 - fits[g.name] * g.bytes_per_slot / (units * unit) for g in groups)

    candidates = range(widest, widest + min(widest // 8, 64) + 1)
    row = min(candidates, key=lambda r: padding(block_size * r))
    return block_size * row * unit, fit(block_size * row)


@dataclass(frozen=True)
class CacheLayout:
    """How a block splits into every group's slots: computed once, shared by the cache manager (which
    counts blocks) and the pools (which view them), so the two cannot disagree."""

    groups: tuple[CacheGroup, ...]
    block_size: int
    block_bytes: int
    slots_per_block: dict[str, int]

    @classmethod
    def of(cls, groups: tuple[CacheGroup, ...], block_size: int) -> CacheLayout:
        if block_size < 1:
            raise ValueError(f"block_size: {block_size} must be >= 1")
        return cls(groups, block_size, *block_layout(groups, block_size))

    @classmethod
    def for_model(
        cls, cfg: ModelConfig, dtype: torch.dtype, block_size: int, kv_cache_dtype: str = "auto"
    ) -> CacheLayout:
        return cls.of(
            cache_groups(cfg, torch.empty(0, dtype=dtype).element_size(), kv_cache_dtype), block_size
        )

    @property
    def kv_cache_dtype(self) -> str:
        return self.groups[0].kv_cache_dtype


def group_name(ratio: int) -> str:
    return "window" if ratio == 0 else f"compressed_r{ratio}"


@dataclass(frozen=True)
class PoolRows:
    """One layer's rows of one kind, views of the cache buffer: ``data [num_slots, width]`` in the compute
    dtype, or quantised (``RowFormat``): ``data`` the codes ``[num_slots, width - rope]``, ``scale
    [num_slots]`` fp32 and ``rope [num_slots, rope]`` (None for index keys)."""

    data: torch.Tensor
    scale: torch.Tensor | None = None
    rope: torch.Tensor | None = None

    def write(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Store ``rows [M, width]`` at ``slots [M]``, quantised as the cache keeps them."""
        if self.scale is None:
            self.data[slots] = rows.to(self.data.dtype)
        else:
            store_quantized(rows, slots, QuantizedRows(self.data, self.scale, self.rope))

    def attended(self, indices: torch.Tensor) -> KVPool:
        """The rows as sparse attention reads them, at ``indices`` (decoded in the op, never copied)."""
        return KVPool(self.data, indices, self.scale, self.rope)


class KVPools:
    """Every layer's pools as views over one ``[num_blocks, block_bytes]`` buffer."""

    def __init__(
        self, cfg: ModelConfig, layout: CacheLayout, num_blocks: int, dtype: torch.dtype, device: torch.device
    ):
        elt = torch.empty(0, dtype=dtype).element_size()
        if layout.groups != cache_groups(cfg, elt, layout.kv_cache_dtype):
            raise ValueError(f"layout: groups {layout.groups} are not this model's groups in {dtype}")
        self.cfg, self.layout, self.dtype, self.device = cfg, layout, dtype, device
        self.groups, self.block_size = layout.groups, layout.block_size
        self.block_bytes, self.slots_per_block = layout.block_bytes, layout.slots_per_block
        # The ratios whose layers attend to every visible entry (HCA): their steps list those entries.
        self.every_entry_ratios = {p.compress_ratio for p in build_plan(cfg) if p.attention is Attention.HCA}
        # Every group's rows are multiples of the scale's 4 bytes when quantised: the buffer stays typed.
        self._build(torch.zeros(num_blocks, self.block_bytes // elt, dtype=dtype, device=device))

    def grow(self, num_blocks: int) -> None:
        """More blocks, keeping the contents of the present ones (slot ids stay valid)."""
        buffer = self.buffer.new_zeros(num_blocks, self.buffer.shape[1])
        buffer[: self.num_blocks] = self.buffer
        self._build(buffer)

    def _build(self, buffer: torch.Tensor) -> None:
        self.buffer, self.num_blocks = buffer, buffer.shape[0]
        self.window: dict[int, PoolRows] = {}
        self.entries: dict[int, PoolRows] = {}
        self.index_keys: dict[int, PoolRows] = {}
        # Each group's rows tile every block exactly (``block_layout``), so ``view`` never copies: a pool
        # is a byte range of its group's rows, and writes through it land in the buffer.
        data = buffer.view(torch.uint8)
        rows = {name: data.view(-1, self.block_bytes // n) for name, n in self.slots_per_block.items()}
        offsets = dict.fromkeys(rows, 0)
        elt = buffer.element_size()
        for fmt in row_formats(self.cfg, elt, self.layout.kv_cache_dtype):
            start = offsets[fmt.group]
            offsets[fmt.group] += fmt.nbytes
            record = rows[fmt.group][:, start : start + fmt.nbytes]
            if fmt.codes is None:
                pool = PoolRows(record.view(self.dtype))
            else:
                rope_end = SCALE_BYTES + fmt.rope * elt
                scale = record[:, :SCALE_BYTES].view(torch.float32)[:, 0]
                codes = record[:, rope_end : rope_end + fmt.width - fmt.rope].view(fmt.codes)
                pool = PoolRows(
                    codes, scale, record[:, SCALE_BYTES:rope_end].view(self.dtype) if fmt.rope else None
                )
            getattr(self, fmt.kind)[fmt.layer] = pool


@dataclass
class SeqCache:
    """One request's block tables and dense state."""

    tables: dict[str, list[int]]  # group name -> block ids, -1 where freed
    compressors: dict[int, CompressorState] = field(default_factory=dict)  # layer -> its compressor's
    indexers: dict[int, CompressorState] = field(default_factory=dict)  # V4 CSA layer -> its indexer's
    engram_history: torch.Tensor | None = None
    num_tokens: int = 0
    checkpoint: tuple[int, torch.Tensor | None] | None = None  # (num_tokens, engram_history) at ``speculate``

    def speculate(self) -> None:
        """The next call may be partly rolled back (speculative decoding): remember where it starts."""
        self.checkpoint = (self.num_tokens, self.engram_history)
        for state in (*self.compressors.values(), *self.indexers.values()):
            state.speculate()

    def rollback(self, keep: int) -> torch.Tensor | None:
        """Keep the first ``keep`` tokens of the call since ``speculate``: the dense state as if only they had
        come. Pool rows written for later tokens stay but are never read: no position or entry past the
        request's tokens is visible, and a later call writes them again before reading. Returns the Engram
        history at ``speculate`` (the model advances it over the kept tokens)."""
        if self.checkpoint is None:
            raise ValueError("rollback without speculate")
        (start, history), self.checkpoint = self.checkpoint, None
        if not 0 <= keep <= self.num_tokens - start:
            raise ValueError(f"keep={keep} must be in [0, {self.num_tokens - start}] (tokens of the call)")
        for state in (*self.compressors.values(), *self.indexers.values()):
            state.rollback(keep)
        self.num_tokens = start + keep
        return history


@dataclass(frozen=True)
class SavedCompressor:
    """A compressor's state on a window boundary: its open window is empty, so only the shape of that
    buffer and (ratio 4 with overlap) the last group's Ca rows are kept."""

    buffer_shape: tuple[int, ...]
    overlap: tuple[torch.Tensor, torch.Tensor] | None
    device: torch.device

    @classmethod
    def of(cls, state: CompressorState) -> SavedCompressor:
        pending = state.pending
        if state.num_tokens % (pending.buffer_kv.shape[1] + 1):
            raise ValueError(f"{state.num_tokens} tokens seen: the compressor has an open window")
        overlap = None
        if pending.overlap_kv is not None and pending.overlap_gate is not None:
            overlap = (pending.overlap_kv.clone(), pending.overlap_gate.clone())
        return cls(tuple(pending.buffer_kv.shape), overlap, pending.buffer_kv.device)

    def restore(self, num_tokens: int) -> CompressorState:
        buffer = torch.zeros(self.buffer_shape, device=self.device)
        slices = tuple(t.clone() for t in self.overlap) if self.overlap else ()
        return CompressorState(CompressorStates(buffer, buffer.clone(), *slices), num_tokens)


@dataclass(frozen=True)
class BoundaryState:
    """A request's dense state at a page boundary, for requests that continue from there."""

    num_tokens: int
    compressors: dict[int, SavedCompressor]
    indexers: dict[int, SavedCompressor]
    engram_history: torch.Tensor | None

    @classmethod
    def of(cls, seq: SeqCache) -> BoundaryState:
        history = None if seq.engram_history is None else seq.engram_history.clone()
        return cls(
            seq.num_tokens,
            {layer: SavedCompressor.of(state) for layer, state in seq.compressors.items()},
            {layer: SavedCompressor.of(state) for layer, state in seq.indexers.items()},
            history,
        )

    def resume(self, tables: dict[str, list[int]]) -> SeqCache:
        """A request's cache over ``tables`` continuing from the boundary (the state is copied)."""
        return SeqCache(
            tables,
            {layer: saved.restore(self.num_tokens) for layer, saved in self.compressors.items()},
            {layer: saved.restore(self.num_tokens) for layer, saved in self.indexers.items()},
            None if self.engram_history is None else self.engram_history.clone(),
            self.num_tokens,
        )


@dataclass(frozen=True)
class DecodeShape:
    """A decode step padded to a captured size: ``rows`` requests of ``width`` tokens each (1 + drafts),
    block tables ``blocks`` wide, no request past ``tokens`` tokens (so past ``tokens // ratio`` entries of
    a compressed group). Every tensor of such a step has a shape these fix, so the step can replay as a
    graph; its last rows may be padding (no blocks, every position -1, never advanced)."""

    rows: int
    width: int
    blocks: int
    tokens: int


@dataclass(frozen=True)
class CompressMeta:
    """One compress ratio's metadata for a step of fixed shape: the op's batch, where every token is its
    own output row (``-1`` where it closes no window), and each row's request and entry number."""

    batch: CompressBatch
    request: torch.Tensor  # [T]
    numbers: torch.Tensor  # [T], -1 where no window closes


@dataclass(frozen=True)
class EntryMeta:
    """One compressed group's per-step metadata, built on the host with the batch (every layer of the
    group reads it; a graph copies it in with the step's other tensors)."""

    visible: torch.Tensor  # [T] int32: the entries each token sees, (position + 1) // ratio
    key_table: torch.Tensor  # [B, blocks] int32: the block table up to the last block any token sees
    every: torch.Tensor | None  # [T, max_entries] int32: every entry each token sees, -1 beyond (HCA)


Effect = Callable[..., None]


@dataclass
class Batch:
    """One call: the tokens of several requests, flat, and where their KV lives."""

    pools: KVPools
    seqs: list[SeqCache]
    bounds: list[tuple[int, int]]  # rows of each request's tokens
    positions: torch.Tensor  # [T] int64
    request: torch.Tensor  # [T] int32: index into seqs
    tables: dict[str, torch.Tensor]  # group -> [B, max_blocks] int64, -1 padded
    window_write: torch.Tensor  # [T]: slot of each token's window key
    window_read: torch.Tensor  # [T, W]: slots of its W newest positions, -1 before position 0
    shape: DecodeShape | None = None  # set: a step of fixed shape (a graph may replay it)
    padding: int = 0  # trailing rows of ``seqs`` that are padding
    compress: dict[int, CompressMeta] = field(default_factory=dict)  # by ratio, with ``shape`` only
    engram_history: torch.Tensor | None = None  # [B, N_max - 1] look-backs, -1 first; ``shape`` only
    entries: dict[int, EntryMeta] = field(default_factory=dict)  # by compress ratio
    # What the step leaves to the host: each run with the batch and its tensors once the forward is done.
    effects: list[tuple[Effect, tuple[torch.Tensor, ...]]] = field(default_factory=list)
    shared: dict[tuple, Any] = field(default_factory=dict)  # metadata every layer of the step reads

    @classmethod
    def build(
        cls,
        pools: KVPools,
        seqs: list[SeqCache],
        lengths: list[int],
        device: torch.device,
        shape: DecodeShape | None = None,
        padding: int = 0,
    ) -> Batch:
        """Per-step metadata, vectorised: request i continues at ``num_tokens`` with ``lengths[i]`` tokens.
        With ``shape``, the requests (their last ``padding`` rows padding) fill it exactly."""
        if shape is not None and (len(seqs), set(lengths)) != (shape.rows, {shape.width}):
            raise ValueError(f"{len(seqs)} requests of lengths {sorted(set(lengths))} do not fill {shape}")
        starts = torch.tensor([s.num_tokens for s in seqs], dtype=torch.int64)
        counts = torch.tensor(lengths, dtype=torch.int64)
        request = torch.repeat_interleave(torch.arange(len(seqs)), counts)
        ends = counts.cumsum(0)
        positions = starts[request] + torch.arange(int(ends[-1])) - (ends - counts)[request]
        # Padding tokens sit at position -1: before any position, they see nothing (and close no window).
        positions = positions.masked_fill(request >= len(seqs) - padding, -1)
        width = max(max((len(s.tables[g.name]) for s in seqs), default=0) for g in pools.groups)
        if shape is not None:
            if width > shape.blocks:
                raise ValueError(f"block tables: {width} blocks exceed the step's {shape.blocks}")
            if (longest := max(s.num_tokens for s in seqs) + shape.width) > shape.tokens:
                raise ValueError(f"requests: {longest} tokens exceed the step's {shape.tokens}")
            width = shape.blocks
        tables = {}
        for g in pools.groups:
            rows = [s.tables[g.name] + [-1] * (width - len(s.tables[g.name])) for s in seqs]
            tables[g.name] = torch.tensor(rows, dtype=torch.int64).view(len(seqs), width)
        _check_tables(tables, pools.num_blocks)
        window = pools.cfg.sliding_window
        back = (positions[:, None] - torch.arange(window)).to(torch.int32)
        batch = cls(pools, seqs, list(zip((ends - counts).tolist(), ends.tolist(), strict=True)), positions,
                    request.to(torch.int32), tables, positions, back, shape, padding)  # fmt: skip
        batch.window_write = batch.slots("window", request, positions)
        batch.window_read = batch.slots("window", request, back)
        every = pools.every_entry_ratios
        batch.entries = {g.ratio: batch._entry_meta(g.ratio, g.ratio in every) for g in pools.groups[1:]}
        if shape is not None:
            batch.compress = {
                g.ratio: _compress_meta(g.ratio, shape, positions, request) for g in pools.groups[1:]
            }
            batch.engram_history = _look_backs(pools.cfg, seqs)
        return batch.to(device)

    def tensors(self) -> list[torch.Tensor]:
        """Every per-step tensor, in a fixed order: what a graph of this shape reads."""
        metas = [
            t
            for _, m in sorted(self.compress.items())
            for t in (*vars(m.batch).values(), m.request, m.numbers)
        ]
        history = [] if self.engram_history is None else [self.engram_history]
        tables = [self.tables[g.name] for g in self.pools.groups]
        entries = [t for _, m in sorted(self.entries.items()) for t in vars(m).values() if t is not None]
        head = [self.positions, self.request, self.window_write, self.window_read]
        return [*head, *tables, *metas, *history, *entries]

    def after(self, effect: Effect, *tensors: torch.Tensor) -> None:
        """Run ``effect(batch, *tensors)``, host bookkeeping of the forward: at once, or with ``shape`` once
        ``finish`` is called (a replayed graph runs no host code: it hands the tensors back instead)."""
        if self.shape is None:
            effect(self, *tensors)
        else:
            self.effects.append((effect, tensors))

    def finish(self, effects: list[tuple[Effect, tuple[torch.Tensor, ...]]] | None = None) -> None:
        """Run the deferred effects: this batch's, or those a graph recorded with its replay's tensors."""
        for effect, tensors in self.effects if effects is None else effects:
            effect(self, *tensors)
        self.effects = []

    def to(self, device: torch.device) -> Batch:
        if self.positions.device == torch.device(device):  # built where it runs (the CPU): nothing moves
            return self
        self.shared = {}  # what the host built for its own slots stays there
        for name in ("positions", "request", "window_write", "window_read"):
            setattr(self, name, getattr(self, name).to(device))
        self.tables = {k: v.to(device) for k, v in self.tables.items()}
        self.compress = {
            r: CompressMeta(CompressBatch(*(t.to(device) for t in vars(m.batch).values())),
                            m.request.to(device), m.numbers.to(device))
            for r, m in self.compress.items()
        }  # fmt: skip
        if self.engram_history is not None:
            self.engram_history = self.engram_history.to(device)
        self.entries = {
            r: EntryMeta(*(None if t is None else t.to(device) for t in vars(m).values()))
            for r, m in self.entries.items()
        }
        return self

    def slots(self, group: str, request: torch.Tensor, numbers: torch.Tensor) -> torch.Tensor:
        """Slots (int32) of positions or entry ``numbers`` (``[M]`` or ``[M, K]``) of requests ``request
        [M]``; a number below 0, past the table, or in a block of id -1, has slot -1."""
        return block_slots(self.tables[group], request, numbers, self.pools.slots_per_block[group])

    def once(self, key: tuple, make: Callable[[], Any]) -> Any:
        """``make()``, built once per step: the layers that need it share it."""
        if key not in self.shared:
            self.shared[key] = make()
        return self.shared[key]

    def visible(self, ratio: int) -> torch.Tensor:
        """Entries visible to each token (int32): entry g is visible at position t iff g < (t+1) // ratio."""
        return self.entries[ratio].visible

    def _entry_meta(self, ratio: int, every: bool) -> EntryMeta:
        visible = ((self.positions + 1) // ratio).to(torch.int32)
        name, entries = group_name(ratio), self.max_entries(ratio)
        blocks = -(-entries // self.pools.slots_per_block[name])
        numbers = torch.arange(entries, dtype=torch.int32).expand(len(self.positions), -1)
        return EntryMeta(
            visible,
            self.tables[name][:, :blocks].to(torch.int32),
            numbers.masked_fill(numbers >= visible[:, None], -1) if every else None,
        )

    def advance(self) -> None:
        """The call is done: every request has seen its tokens."""
        self.after(Batch._advance)

    def _advance(self) -> None:
        for seq, (lo, hi) in zip(self.live_seqs, self.bounds, strict=False):
            seq.num_tokens += hi - lo

    @property
    def live_seqs(self) -> list[SeqCache]:
        """The requests, padding left out."""
        return self.seqs[: len(self.seqs) - self.padding]

    def write(self, pool: PoolRows, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """``pool.write``; with ``shape`` slot -1 (padding, or no window closed) is not written."""
        if self.shape is None or pool.scale is not None:  # the quantised store skips slot -1 itself
            pool.write(slots, rows)
        else:
            store_rows(rows, slots, pool.data)

    def max_entries(self, ratio: int) -> int:
        """Entries of the request that has the most once this call's tokens are in; with ``shape``, the
        most a request of the shape can have (a graph's shapes cannot follow the requests)."""
        if self.shape is not None:
            return self.shape.tokens // ratio
        return max(
            (s.num_tokens + hi - lo) // ratio for s, (lo, hi) in zip(self.seqs, self.bounds, strict=True)
        )

    def every_visible_entry(self, ratio: int) -> torch.Tensor:
        """Entry numbers ``[T, max_entries]`` of every entry each token sees, ``-1`` beyond (HCA layers)."""
        every = self.entries[ratio].every
        if every is None:
            raise ValueError(f"ratio {ratio}: no HCA layer compresses at it, so no entry list was built")
        return every

    def entry_slots(self, ratio: int, numbers: torch.Tensor) -> torch.Tensor:
        """Slots of each token's entry numbers ``[T, K]`` in its request's compressed group."""
        return self._slots_of(group_name(ratio), self.request, numbers)

    def _slots_of(self, group: str, request: torch.Tensor, numbers: torch.Tensor) -> torch.Tensor:
        """``slots``, once per step for the same ``numbers`` (the layers reading one index source, the
        compressors of one ratio)."""
        _, slots = self.once(
            ("slots", group, id(numbers)), lambda: (numbers, self.slots(group, request, numbers))
        )
        return slots

    def store(
        self, pool: PoolRows, ratio: int, request: torch.Tensor, numbers: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """Write ``rows [E, c]``, entries ``numbers [E]`` of the requests ``request [E]``, into ``pool``."""
        if rows.shape[0]:
            self.write(pool, self._slots_of(group_name(ratio), request, numbers), rows)

    def key_pool(self, layer: int, ratio: int) -> KeyPool:
        """Index keys of compressing ``layer`` as the indexer ops read them (int8 with their scales in a
        quantised cache), through the group's block table.

        The table stops at the last block holding an entry visible in this call: the ops score every
        column of it, and the tables are padded to the longest group's (the window's) width."""
        name = group_name(ratio)
        keys = self.pools.index_keys[layer]
        return KeyPool(keys.data, self.entries[ratio].key_table, self.pools.slots_per_block[name], keys.scale)


def _compress_meta(
    ratio: int, shape: DecodeShape, positions: torch.Tensor, request: torch.Tensor
) -> CompressMeta:
    """Token t is output row t where it closes a window (position + 1 a multiple of ``ratio``), of entry
    number (position + 1) / ratio - 1."""
    closes = ((positions + 1) % ratio == 0) & (positions >= 0)
    rows = torch.arange(shape.rows + 1, dtype=torch.int32)
    batch = CompressBatch(
        rows * shape.width,
        positions[:: shape.width].clamp(min=0).to(torch.int32),
        rows[:-1].clone(),
        torch.where(closes, torch.arange(len(positions)), -1).to(torch.int32),
        request.to(torch.int32),
        closing_first(closes),
    )
    return CompressMeta(batch, request, torch.where(closes, (positions + 1) // ratio - 1, -1))


def _look_backs(cfg: ModelConfig, seqs: list[SeqCache]) -> torch.Tensor | None:
    """Each request's Engram look-back ``[B, N_max - 1]``, -1 before it (hashes as before a first token)."""
    if cfg.engram is None:
        return None
    size = cfg.engram.max_ngram_size - 1
    device = next((s.engram_history.device for s in seqs if s.engram_history is not None), None)
    none = torch.zeros(0, dtype=torch.int64, device=device)
    histories = [none if s.engram_history is None else s.engram_history for s in seqs]
    return torch.stack([F.pad(h, (size - h.numel(), 0), value=-1) for h in histories])


def _check_tables(tables: dict[str, torch.Tensor], num_blocks: int) -> None:
    """Block ids in ``[-1, num_blocks)``, checked on the host where the tables are built: every slot the
    ops read or write derives from them, so the ops need no range check of their own (one per call, a
    device-to-host read each, behind ``DSV4_CHECK_RANGES``)."""
    for name, table in tables.items():
        if table.numel() and (int(table.min()) < -1 or int(table.max()) >= num_blocks):
            low, high = int(table.min()), int(table.max())
            raise ValueError(f"{name} block table: ids [{low}, {high}] must lie in [-1, {num_blocks})")


class PrivateStore:
    """Blocks for a model used on its own: tables grow on demand and so does the buffer."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int = 64,
        kv_cache_dtype: str = "auto",
    ):
        check_kv_cache_device(kv_cache_dtype, device)
        layout = CacheLayout.for_model(cfg, dtype, block_size, kv_cache_dtype)
        self.pools = KVPools(cfg, layout, 16, dtype, device)
        self.next_block = 0

    def reserve(self, seq: SeqCache, num_tokens: int) -> None:
        """Give ``seq`` every block it needs to hold ``num_tokens`` tokens."""
        pools = self.pools
        for g in pools.groups:
            table = seq.tables[g.name]
            need = -(-g.slots_needed(num_tokens) // pools.slots_per_block[g.name])
            while len(table) < need:
                if self.next_block == pools.num_blocks:
                    pools.grow(2 * pools.num_blocks)
                table.append(self.next_block)
                self.next_block += 1


@dataclass
class SequenceState:
    """A request served by the model alone: its cache in a private store."""

    store: PrivateStore
    seq: SeqCache

    @classmethod
    def new(
        cls, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, kv_cache_dtype: str = "auto"
    ) -> SequenceState:
        store = PrivateStore(cfg, dtype, device, kv_cache_dtype=kv_cache_dtype)
        return cls(store, SeqCache({g.name: [] for g in store.pools.groups}))

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens

    def batch(self, num_new: int, device: torch.device) -> Batch:
        """Reserve the blocks for ``num_new`` more tokens and describe the call."""
        self.store.reserve(self.seq, self.seq.num_tokens + num_new)
        return Batch.build(self.store.pools, [self.seq], [num_new], device)
