"""Engram n-gram hash and table-row gather (DeepSeek V4.1, model-spec §6.2-§6.4).

Contract
    ``hash_tables(multipliers [L_E, N_max], primes [L_E, cols], offsets [L_E, cols], pad, compressed_vocab,
    device) -> HashTables``: the per-layer constants of the hash, validated once and put on the device
    that hashes. ``cols = (N_max - 1) * h_E``, column ``(s - 1) * h_E + h`` is order ``s + 1``, head ``h``.

    ``engram_hash(cids [H + S] int32/int64, n_history, tables) -> ids [S, L_E, cols] int32``: ``cids`` is
    the request's last ``H <= N_max - 1`` compressed ids (fewer only at the start of the request) followed
    by the chunk's ``S``; ``-1`` marks a dead position. For chunk position ``p`` and look-back ``s``, a
    look-back before the start of ``cids`` or onto a dead position blocks it and every farther one; blocked
    look-backs hash as ``pad``. ``rolling = XOR_s v_s * multipliers[l, s]`` (exact int64, every product is
    below 2**63) and ``ids[p, l, (s-1)*h_E + h] = rolling_s mod primes[l, col] + offsets[l, col]``. Values
    are not range-checked (that would synchronise the device): cids must lie in ``[-1, compressed_vocab)``.

    ``engram_gather(table [rows, d_E] fp32/bf16, ids [...] int32/int64, device) -> [..., d_E]`` on
    ``device``, dtype of ``table``. Where the table lives decides the path: a table on ``device`` (an NPU or
    GPU) is read by the kernel; a table in host memory (the 196B-parameter release tables do not fit the
    device) is gathered on the host with ``index_select`` into a pinned buffer, and only those rows are
    copied to ``device`` (non-blocking; ``ids`` are brought to the host first, a synchronisation unless
    they already live there). A table on another accelerator is an error. ids must be in ``[0, rows)``.

Kernels
    ``_engram_hash_kernel``: exact without int64 vector arithmetic (scalar on Ascend). XOR is bitwise, so
    the XOR of the 63-bit products is the limb-wise XOR of their three 21-bit limbs, and the products
    ``cid * multiplier`` are precomputed per (layer, look-back, cid) as int32 limbs (``HashTables.limbs``,
    12 B per entry: 4.8 MB per layer for the release's 99092 compressed ids). The residue is a Horner sweep
    over the nine 7-bit digits, ``acc = (acc * 128 + digit) mod p``, which stays below 2**31 for primes
    below 2**24 (the release's largest is 16000889). One task is ``BLOCK_S`` positions of one layer, all
    heads at once. ``_engram_gather_kernel``: one task is one (position, column) row; the row offset is an
    int64 scalar (384M rows x 256 exceed int32), the columns an int32 vector of ``BLOCK_D``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from triton_kernels import runtime, tuning
from triton_kernels.shared import take_rows
from triton_kernels.spec import TuneConfig, Variant

_TABLE_DTYPES = (torch.float32, torch.bfloat16)
_ID_DTYPES = (torch.int32, torch.int64)
_MAX_INT32 = 2**31 - 1  # ids and offsets are int32 inside the kernels
_MAX_PRIME = 2**24  # keeps the Horner step acc * 128 + 127 below 2**31
_LIMB_BITS, _LIMBS = 21, 3
_INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class HashTables:
    """Constants of the Engram hash for every Engram layer, on one device (see ``hash_tables``)."""

    multipliers: torch.Tensor  # [L_E, N_max] int64
    limbs: torch.Tensor  # [L_E, N_max, 3, C] int32: 21-bit limbs of cid * multipliers[l, s], low first
    primes: torch.Tensor  # [L_E, cols] int32
    offsets: torch.Tensor  # [L_E, cols] int32
    pad: int

    @property
    def max_ngram_size(self) -> int:
        return self.multipliers.shape[1]

    @property
    def n_heads(self) -> int:
        return self.primes.shape[1] // (self.max_ngram_size - 1)


def hash_tables(
    multipliers: Sequence[Sequence[int]] | np.ndarray,
    primes: Sequence[Sequence[int]] | np.ndarray,
    offsets: Sequence[Sequence[int]] | np.ndarray,
    pad: int,
    compressed_vocab: int,
    device: torch.device | str = "cpu",
) -> HashTables:
    mult, prime, offset = (np.asarray(a, dtype=np.int64) for a in (multipliers, primes, offsets))
    if mult.ndim != 2 or mult.shape[0] < 1 or mult.shape[1] < 2:
        raise ValueError(f"multipliers: shape {mult.shape} must be [L_E >= 1, N_max >= 2]")
    n_layers, n_max = mult.shape
    if prime.ndim != 2 or prime.shape[0] != n_layers or prime.shape[1] % (n_max - 1) or prime.shape[1] == 0:
        raise ValueError(
            f"primes: shape {prime.shape} must be [{n_layers}, (N_max - 1) * h_E] = [..., k * {n_max - 1}]"
        )
    if offset.shape != prime.shape:
        raise ValueError(f"offsets: shape {offset.shape} must equal the primes' {prime.shape}")
    if not 1 <= compressed_vocab <= _MAX_INT32 // (_LIMBS * mult.size):
        raise ValueError(
            f"compressed_vocab: {compressed_vocab} outside [1, {_MAX_INT32 // (_LIMBS * mult.size)}]"
        )
    if not 0 <= pad < compressed_vocab:
        raise ValueError(f"pad: {pad} outside [0, {compressed_vocab})")
    bound = _INT64_MAX // max(1, compressed_vocab - 1)
    for (layer, s), m in np.ndenumerate(mult):
        if m <= 0 or m % 2 == 0 or m > bound:
            raise ValueError(
                f"multipliers[{layer}][{s}]: {m} must be odd and in [1, {bound}] (cid * multiplier < 2**63)"
            )
    for (layer, col), p in np.ndenumerate(prime):
        if not 2 <= p < _MAX_PRIME:
            raise ValueError(f"primes[{layer}][{col}]: {p} outside [2, {_MAX_PRIME})")
        if not 0 <= offset[layer, col] <= _MAX_INT32 - p:
            raise ValueError(f"offsets[{layer}][{col}]: {offset[layer, col]} outside [0, {_MAX_INT32 - p}]")
    products = np.arange(compressed_vocab, dtype=np.int64)[None, None, :] * mult[:, :, None]
    shifts = np.arange(_LIMBS, dtype=np.int64)[None, None, :, None] * _LIMB_BITS
    limbs = (products[:, :, None, :] >> shifts) & ((1 << _LIMB_BITS) - 1)
    return HashTables(
        multipliers=torch.from_numpy(mult).to(device),
        limbs=torch.from_numpy(limbs.astype(np.int32)).to(device),
        primes=torch.from_numpy(prime.astype(np.int32)).to(device),
        offsets=torch.from_numpy(offset.astype(np.int32)).to(device),
        pad=int(pad),
    )


def engram_hash(cids: torch.Tensor, n_history: int, tables: HashTables) -> torch.Tensor:
    _validate_hash(cids, n_history, tables)
    if runtime.use_triton(cids):
        return engram_hash_triton(cids, n_history, tables)
    return engram_hash_ref(cids, n_history, tables)


def _validate_hash(cids: torch.Tensor, n_history: int, tables: HashTables) -> None:
    if cids.dtype not in _ID_DTYPES or cids.dim() != 1:
        raise ValueError(f"cids: {cids.dtype} {tuple(cids.shape)} must be a 1-D tensor of {_ID_DTYPES}")
    if cids.device != tables.limbs.device:
        raise ValueError(f"cids: device {cids.device} differs from the tables' device {tables.limbs.device}")
    limit = min(tables.max_ngram_size - 1, cids.numel())
    if not 0 <= n_history <= limit:
        raise ValueError(f"n_history: {n_history} outside [0, {limit}] (N_max - 1, or the length of cids)")
    numel = (cids.numel() - n_history) * tables.primes.numel()
    if numel > _MAX_INT32:
        raise ValueError(f"cids: {numel} output ids exceed the limit {_MAX_INT32}")


def engram_hash_ref(cids: torch.Tensor, n_history: int, tables: HashTables) -> torch.Tensor:
    mult, heads = tables.multipliers, tables.n_heads
    idx = torch.arange(n_history, cids.numel(), device=cids.device)
    blocked = torch.zeros_like(idx, dtype=torch.bool)
    rolling = torch.zeros((mult.shape[0], idx.numel()), dtype=torch.int64, device=cids.device)
    ids = []
    for s in range(tables.max_ngram_size):
        src = cids.long()[(idx - s).clamp(min=0)]
        blocked |= (idx - s < 0) | (src < 0)
        v = torch.where(blocked, tables.pad, src)
        rolling ^= v[None, :] * mult[:, s : s + 1]
        if s >= 1:
            cols = slice((s - 1) * heads, s * heads)
            prime, offset = tables.primes[:, None, cols].long(), tables.offsets[:, None, cols].long()
            ids.append(rolling[:, :, None] % prime + offset)
    return torch.cat(ids, dim=-1).transpose(0, 1).to(torch.int32)


@triton.jit
def _horner21(acc, limb, p):
    # The three 7-bit digits of one 21-bit limb, most significant first.
    for k in tl.static_range(3):
        acc = (acc * 128 + ((limb[:, None] >> (14 - 7 * k)) & 127)) % p[None, :]
    return acc


@triton.jit(do_not_specialize=["S", "H"])
def _engram_hash_kernel(
    cid_ptr,
    limb_ptr,
    prime_ptr,
    offset_ptr,
    out_ptr,
    S,
    H,
    C,
    n_layers,
    pad,
    N_MAX: tl.constexpr,
    HEADS: tl.constexpr,
    HP: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = (N_MAX - 1) * HEADS
    hh = tl.arange(0, HP)
    h_ok = hh < HEADS
    s_tiles = tl.cdiv(S, BLOCK_S)
    for task in range(pid, n_layers * s_tiles, tl.num_programs(0)):
        layer = task // s_tiles
        pos = (task % s_tiles) * BLOCK_S + tl.arange(0, BLOCK_S)
        pos_ok = pos < S
        blocked = pos < 0
        l0 = tl.zeros([BLOCK_S], dtype=tl.int32)
        l1 = tl.zeros([BLOCK_S], dtype=tl.int32)
        l2 = tl.zeros([BLOCK_S], dtype=tl.int32)
        for s in tl.static_range(N_MAX):
            idx = H + pos - s
            # Before the start of cids reads as dead: both block this and every farther look-back.
            inside = pos_ok & (idx >= 0)
            c = tl.load(cid_ptr + tl.where(inside, idx, 0), mask=inside, other=-1)  # in-bounds: clamped
            blocked = blocked | (c < 0)
            limb = limb_ptr + (layer * N_MAX + s) * 3 * C + tl.where(blocked, pad, c)
            l0 = l0 ^ tl.load(limb, mask=pos_ok, other=0)
            l1 = l1 ^ tl.load(limb + C, mask=pos_ok, other=0)
            l2 = l2 ^ tl.load(limb + 2 * C, mask=pos_ok, other=0)
            if s >= 1:
                col = (s - 1) * HEADS + hh
                p = tl.load(prime_ptr + layer * cols + col, mask=h_ok, other=1)
                acc = tl.zeros([BLOCK_S, HP], dtype=tl.int32)
                acc = _horner21(_horner21(_horner21(acc, l2, p), l1, p), l0, p)
                acc += tl.load(offset_ptr + layer * cols + col, mask=h_ok, other=0)[None, :]
                out = out_ptr + (pos[:, None] * n_layers + layer) * cols + col[None, :]
                tl.store(out, acc, mask=pos_ok[:, None] & h_ok[None, :])


def engram_hash_triton(cids: torch.Tensor, n_history: int, tables: HashTables) -> torch.Tensor:
    n_layers, cols = tables.primes.shape
    s = cids.numel() - n_history
    out = torch.empty((s, n_layers, cols), dtype=torch.int32, device=cids.device)
    if s > 0:
        heads = tables.n_heads
        _engram_hash_tuned[lambda meta: _engram_hash_tuned.grid(n_layers * triton.cdiv(s, meta["BLOCK_S"]))](
            cids.to(torch.int32).contiguous(),
            tables.limbs,
            tables.primes,
            tables.offsets,
            out,
            s,
            n_history,
            tables.limbs.shape[-1],
            n_layers,
            tables.pad,
            N_MAX=tables.max_ngram_size,
            HEADS=heads,
            HP=triton.next_power_of_2(heads),
        )
    return out


def engram_gather(table: torch.Tensor, ids: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    device = torch.device(device)
    _validate_gather(table, ids, device)
    if table.device.type == "cpu":
        flat = ids.reshape(-1).to("cpu", torch.int64)
        # Pinned staging lets the copy to the device run asynchronously.
        rows = torch.empty((flat.numel(), table.shape[1]), dtype=table.dtype, pin_memory=device.type != "cpu")
        torch.index_select(table, 0, flat, out=rows)
        return rows.to(device, non_blocking=True).view(*ids.shape, table.shape[1])
    if runtime.use_triton(table):
        return engram_gather_triton(table, ids.to(device))
    return engram_gather_ref(table, ids.to(device))


def _validate_gather(table: torch.Tensor, ids: torch.Tensor, device: torch.device) -> None:
    if table.dtype not in _TABLE_DTYPES or table.dim() != 2 or table.shape[1] < 1:
        raise ValueError(f"table: {table.dtype} {tuple(table.shape)} must be [rows, d_E] of {_TABLE_DTYPES}")
    if table.device.type != "cpu" and table.device != device:
        raise ValueError(f"table: device {table.device} is neither the host nor the output device {device}")
    if ids.dtype not in _ID_DTYPES:
        raise ValueError(f"ids: dtype {ids.dtype} not supported, expected one of {_ID_DTYPES}")
    if ids.numel() * table.shape[1] > _MAX_INT32:
        raise ValueError(f"ids: {ids.numel()} rows of {table.shape[1]} exceed {_MAX_INT32} elements")


def engram_gather_ref(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return take_rows(table, ids.long())


@triton.jit(do_not_specialize=["R"])
def _engram_gather_kernel(table_ptr, ids_ptr, out_ptr, R, D, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    for task in range(pid, R, tl.num_programs(0)):
        src = table_ptr + tl.load(ids_ptr + task).to(tl.int64) * D
        dst = out_ptr + task * D
        for d0 in range(0, D, BLOCK_D):
            cc = d0 + tl.arange(0, BLOCK_D)
            ok = cc < D
            tl.store(dst + cc, tl.load(src + cc, mask=ok), mask=ok)


def engram_gather_triton(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    d = table.shape[1]
    out = torch.empty((*ids.shape, d), dtype=table.dtype, device=table.device)
    if ids.numel() > 0:
        _engram_gather_tuned[lambda meta: _engram_gather_tuned.grid(ids.numel())](
            table.contiguous(), ids.reshape(-1).to(torch.int32).contiguous(), out, ids.numel(), d
        )
    return out


# Representative release values: 4-grams, 8 heads per order.
_N_MAX, _HEADS = 4, 8


def _hash_ub(block_s: int) -> int:
    # Limb, index, mask and cid vectors per position, plus about six [BLOCK_S, HEADS] int32 tiles of the
    # Horner sweep (digit, product, remainder, offsets, store).
    return 4 * (12 * block_s + 6 * block_s * _HEADS)


_HASH_CONFIGS = tuple(TuneConfig({"BLOCK_S": bs}, _hash_ub(bs)) for bs in (64, 256))
# The loaded row tile and its copy to the store.
_GATHER_CONFIGS = tuple(TuneConfig({"BLOCK_D": bd}, 4 * 2 * bd) for bd in (256, 1024))

_HASH_SIGNATURE = {
    **dict.fromkeys(("cid_ptr", "limb_ptr", "prime_ptr", "offset_ptr", "out_ptr"), "*i32"),
    **dict.fromkeys(("S", "H", "C", "n_layers", "pad"), "i32"),
}


def _gather_signature(table: str) -> dict[str, str]:
    return {"table_ptr": table, "ids_ptr": "*i32", "out_ptr": table, "R": "i32", "D": "i32"}


_engram_hash_tuned = tuning.TunedKernel(
    _engram_hash_kernel,
    _HASH_CONFIGS,
    key=["N_MAX", "HEADS"],
    # The model's heads per order, and the toy's two: the narrowest head tile.
    variants=tuple(
        Variant({"N_MAX": _N_MAX, "HEADS": heads, "HP": heads}, (_HASH_SIGNATURE,)) for heads in (_HEADS, 2)
    ),
)
_engram_gather_tuned = tuning.TunedKernel(
    _engram_gather_kernel,
    _GATHER_CONFIGS,
    key=["D"],
    variants=(Variant({}, (_gather_signature("*fp32"), _gather_signature("*bf16"))),),
)
KERNELS = (_engram_hash_tuned, _engram_gather_tuned)
