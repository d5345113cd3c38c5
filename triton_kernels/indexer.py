"""Lightning indexer (model-spec §4.6, §4.9): logits, fused top-k and the two-level TopK ops.

Layout
    ``IndexQueries``: a ragged token-major batch: ``q [T, H, D]`` (fp32 / bf16, or int8 with a
    per-(token, head) ``scale [T, H]``), head weights ``[T, H]`` fp32 (every factor of the score
    folded in, e.g. ``d^-1/2 * H^-1/2``), the block-table row of each token ``request [T]`` int32 and
    its visible entry count ``visible [T]`` int32 (entries ``j < visible[t]``; ``(pos + 1) // ratio``
    for a compressed layer). A decode batch is one token per request.
    ``KeyPool``: the flat paged indexer-key pool ``keys [num_slots, D]`` (fp32 / bf16, or int8 with a
    per-slot ``scale [num_slots]``; scales are ``>= 0``, as ``quant.quantize_int8`` makes them; keys and
    scales may be column ranges of a wider buffer, read at their row stride),
    ``block_table [R, max_blocks]`` int32 (``-1`` unused) and ``block_size``: entry ``j`` of request
    ``r`` lives at slot ``block_table[r, j // block_size] * block_size + j % block_size``. A slot list
    is the ``block_size = 1`` case; ``KeyPool.dense`` wraps one request's keys ``[E, D]``. Queries and
    keys are int8 together or not at all.

Contract
    ``indexer_logits(queries, pool) -> [T, capacity]`` fp32, ``capacity = max_blocks * block_size``:
    ``logits[t, j] = sum_h w[t, h] * relu(q[t, h] . k_j)`` for ``j < visible[t]``, ``-inf`` elsewhere;
    int8 operands are dequantised (``q * scale``) in the reference, the kernel accumulates
    ``int8 x int8 -> int32`` and rescales in fp32.
    ``indexer_topk(queries, pool, k) -> [T, k]`` int32 = ``topk_positions(logits, k)`` (see
    ``topk``: ascending, ``-1`` padded, lower position wins ties), without materialising the logits.
    ``indexer_topk_and_candidates(queries, pool, k, block_size, topk_blocks)`` (candidate source) ->
    ``(indexer_topk(...), candidate_blocks(logits, visible, block_size, topk_blocks))``.
    ``indexer_topk_in_candidates(queries, pool, k, candidates [T, C], block_size)`` (consumer):
    ``candidates`` are block ids of ``block_size`` positions, ascending, ``-1`` padded at the end; the
    logits are scored only inside them (``-inf`` elsewhere) and the top-k taken there; a pick whose
    score is ``-inf`` is ``-1``. With candidates covering every visible block it equals ``indexer_topk``.
    Limits (``limits``): ``H <= INDEXER_MAX_HEADS``, ``D <= INDEXER_MAX_DIM`` (the tuned tiles hold a whole
    query), ``k`` and ``topk_blocks <= MAX_K``, candidate ``block_size`` a power of two
    ``<= MAX_CANDIDATE_BLOCK``.

Kernels
    ``_score_keys`` scores ``BLOCK_N`` keys gathered through the block table against one query on
    the cube unit (``[H, D] x [D, BLOCK_N]``, int32 for int8), then ReLU, weights and head sum on the
    vector unit. ``_indexer_logits_kernel``: one task is (token, ``BLOCK_N`` keys), so a long decode
    row still spreads over every core. ``_indexer_topk_kernel``: one task is a token; its logits go
    to a per-program scratch row of HBM (``grid x width``, not ``T x width``), then ``shared.select_row``
    picks from it; ``MODE`` 1 also takes block maxima and picks the candidate blocks, ``MODE`` 2
    scores the slots of the candidate blocks only. A decode batch has fewer tokens than cores
    (``score_split``): its rows are scored by the logits kernel over every core, then selected by
    ``topk``'s kernels (one HBM round trip of the logits; the consumer's few candidate slots stay fused).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from triton_kernels import runtime, topk, tuning
from triton_kernels.limits import INDEXER_MAX_DIM, INDEXER_MAX_HEADS, MAX_K, check_candidate_geometry, check_k
from triton_kernels.shared import block_maxima, gather_rows, select_row, take_rows
from triton_kernels.spec import TuneConfig, Variant
from triton_kernels.topk import candidate_blocks_ref, check_tensor

_FLOAT_DTYPES = (torch.float32, torch.bfloat16)
_MAX_NUMEL = 2**31 - 1  # offsets are int32 inside the kernels
_PLAIN, _SOURCE, _CONSUMER = 0, 1, 2
_REF_CHUNK = 1 << 22  # elements of the reference's largest temporary


@dataclass(frozen=True)
class IndexQueries:
    q: torch.Tensor  # [T, H, D] fp32 | bf16 | int8
    weights: torch.Tensor  # [T, H] fp32
    request: torch.Tensor  # [T] int32: block-table row
    visible: torch.Tensor  # [T] int32: entries j < visible[t] are visible
    scale: torch.Tensor | None = None  # [T, H] fp32, int8 q only


@dataclass(frozen=True)
class KeyPool:
    keys: torch.Tensor  # [num_slots, D] fp32 | bf16 | int8
    block_table: torch.Tensor  # [R, max_blocks] int32, -1 = unused
    block_size: int
    scale: torch.Tensor | None = None  # [num_slots] fp32, int8 keys only

    @classmethod
    def dense(cls, keys: torch.Tensor, scale: torch.Tensor | None = None) -> KeyPool:
        """One request whose entry j is slot j (an identity slot list)."""
        table = torch.arange(keys.shape[0], dtype=torch.int32, device=keys.device)[None]
        return cls(keys, table, 1, scale)

    @property
    def capacity(self) -> int:
        return self.block_table.shape[1] * self.block_size


def indexer_logits(queries: IndexQueries, pool: KeyPool) -> torch.Tensor:
    _validate(queries, pool)
    run = indexer_logits_triton if runtime.use_triton(queries.q) else indexer_logits_ref
    return run(queries, pool)


def indexer_topk(queries: IndexQueries, pool: KeyPool, k: int) -> torch.Tensor:
    _validate(queries, pool)
    check_k("k", k, MAX_K)
    run = indexer_topk_triton if runtime.use_triton(queries.q) else indexer_topk_ref
    return run(queries, pool, k)


def indexer_topk_and_candidates(
    queries: IndexQueries, pool: KeyPool, k: int, block_size: int, topk_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    _validate(queries, pool)
    check_k("k", k, MAX_K)
    check_candidate_geometry(block_size, topk_blocks)
    use = runtime.use_triton(queries.q)
    run = indexer_topk_and_candidates_triton if use else indexer_topk_and_candidates_ref
    return run(queries, pool, k, block_size, topk_blocks)


def indexer_topk_in_candidates(
    queries: IndexQueries, pool: KeyPool, k: int, candidates: torch.Tensor, block_size: int
) -> torch.Tensor:
    _validate(queries, pool, candidates, block_size)
    check_k("k", k, MAX_K)
    use = runtime.use_triton(queries.q)
    run = indexer_topk_in_candidates_triton if use else indexer_topk_in_candidates_ref
    return run(queries, pool, k, candidates, block_size)


def _validate(
    queries: IndexQueries, pool: KeyPool, candidates: torch.Tensor | None = None, cand_block: int = 1
) -> None:
    q, keys = queries.q, pool.keys
    if q.dtype not in (*_FLOAT_DTYPES, torch.int8):
        raise ValueError(f"q: dtype {q.dtype} not supported, expected int8 or one of {_FLOAT_DTYPES}")
    heads, dim = INDEXER_MAX_HEADS, INDEXER_MAX_DIM
    if q.dim() != 3 or not 1 <= q.shape[1] <= heads or not 1 <= q.shape[2] <= dim:
        raise ValueError(f"q: shape {tuple(q.shape)} must be [T, H, D], 1 <= H <= {heads}, 1 <= D <= {dim}")
    t, h, d = q.shape
    quant = q.dtype == torch.int8
    dtypes = (torch.int8,) if quant else _FLOAT_DTYPES
    if keys.dtype not in dtypes or keys.dim() != 2 or keys.shape[1] != d or keys.device != q.device:
        raise ValueError(
            f"keys: {keys.dtype} {tuple(keys.shape)} on {keys.device} must be [num_slots, {d}] on {q.device},"
            f" dtype in {dtypes} (int8 exactly when q is int8)"
        )
    check_tensor("weights", queries.weights, torch.float32, (t, h), q.device)
    for name, scale, shape in (
        ("q scale", queries.scale, (t, h)),
        ("keys scale", pool.scale, keys.shape[:1]),
    ):
        if (scale is not None) != quant:
            raise ValueError(f"{name}: must be given exactly when q and keys are int8 (q is {q.dtype})")
        if scale is not None:
            check_tensor(name, scale, torch.float32, shape, q.device)
    check_tensor("request", queries.request, torch.int32, (t,), q.device)
    check_tensor("visible", queries.visible, torch.int32, (t,), q.device)
    table = pool.block_table
    if table.dim() != 2 or table.shape[0] < 1:
        raise ValueError(f"block_table: shape {tuple(table.shape)} must be [R >= 1, max_blocks]")
    check_tensor("block_table", table, torch.int32, table.shape, q.device)
    if pool.block_size < 1:
        raise ValueError(f"block_size: {pool.block_size} must be >= 1")
    if candidates is not None:
        check_candidate_geometry(cand_block, 0)
        check_tensor("candidates", candidates, torch.int32, (t, candidates.shape[-1]), q.device)
    positions = 0 if candidates is None else candidates.numel() * cand_block
    for name, numel in (("keys", keys.numel()), ("logits", t * pool.capacity), ("candidates", positions)):
        if numel > _MAX_NUMEL:
            raise ValueError(f"{name}: {numel} elements exceeds the limit {_MAX_NUMEL}")
    if t > 0 and runtime.check_ranges():
        _check_ranges(queries, pool, candidates, cand_block)


def _check_ranges(
    queries: IndexQueries, pool: KeyPool, candidates: torch.Tensor | None, cand_block: int
) -> None:
    """Index ranges of the host-side contract, read back from the device in one transfer."""
    table, bs = pool.block_table, pool.block_size
    rows, max_blocks = table.shape
    num_blocks = pool.keys.shape[0] // bs
    req, vis = queries.request, queries.visible
    # Blocks a request needs: those holding an entry visible to any of its tokens.
    need = torch.zeros(rows, dtype=torch.int32, device=req.device)
    need = need.scatter_reduce(0, req.clamp(0, rows - 1).long(), vis, "amax")
    needed = torch.arange(max_blocks, device=req.device) < (need[:, None] + bs - 1) // bs
    bad = (needed & ((table < 0) | (table >= num_blocks))).flatten()
    # A trailing sentinel keeps argmax defined for a table without columns.
    first_bad = torch.cat([bad, bad.new_ones(1)]).int().argmax()
    entries = torch.cat([table.flatten(), table.new_zeros(1)])
    stats = [req.min(), req.max(), vis.min(), vis.max(), bad.sum(), first_bad, entries[first_bad]]
    if candidates is not None and candidates.numel() > 0:
        valid = candidates >= 0
        # Valid ids strictly increase, and -1 padding only follows them.
        later = valid[:, 1:]
        disorder = later & (~valid[:, :-1] | (candidates[:, 1:] <= candidates[:, :-1]))
        stats += [candidates.min(), candidates.max(), disorder.sum()]
    s = [int(v) for v in torch.stack(stats).tolist()]
    if s[0] < 0 or s[1] >= rows:
        raise ValueError(f"request: range [{s[0]}, {s[1]}] must lie in [0, {rows}) (block_table rows)")
    if s[2] < 0 or s[3] > pool.capacity:
        raise ValueError(
            f"visible: range [{s[2]}, {s[3]}] must lie in [0, {pool.capacity}] (pool capacity:"
            f" {max_blocks} blocks x {bs})"
        )
    if s[4]:
        r, b = divmod(s[5], max_blocks)
        raise ValueError(
            f"block_table: {s[4]} entries holding visible entries are outside [0, {num_blocks}) (pool"
            f" blocks), first [{r}, {b}] = {s[6]}"
        )
    if len(s) > 7:
        limit = triton.cdiv(pool.capacity, cand_block)
        if s[7] < -1 or s[8] >= limit:
            raise ValueError(
                f"candidates: range [{s[7]}, {s[8]}] must lie in [-1, {limit}) (candidate blocks of the pool)"
            )
        if s[9]:
            raise ValueError(f"candidates: {s[9]} rows break the order: ids ascending, then -1 padding")


def _dequantised(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return x.float() if scale is None else x.float() * scale[..., None]


def _keys_at(pool: KeyPool, slots: torch.Tensor) -> torch.Tensor:
    """The (dequantised) keys at ``slots``: ``[*slots.shape, D]``."""
    return _dequantised(
        take_rows(pool.keys, slots), None if pool.scale is None else take_rows(pool.scale, slots)
    )


def _slots(pool: KeyPool, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Slots of entry ``positions`` in block-table ``rows`` (broadcast together); slot 0 where unused."""
    bs = pool.block_size
    return pool.block_table[rows, positions // bs].long().clamp(min=0) * bs + positions % bs


def _chunk(width: int, q: torch.Tensor) -> int:
    """Tokens at a time, so that the ``[tokens, heads, width]`` products stay small."""
    return max(1, _REF_CHUNK // max(1, width * max(q.shape[1:])))


def _scores(q: torch.Tensor, weights: torch.Tensor, keys_t: torch.Tensor) -> torch.Tensor:
    """``sum_h w_h * relu(q_h . k)``, ``q [t, H, D]`` and ``keys_t [D, N]`` or ``[t, D, N]``: ``[t, N]``."""
    return (q @ keys_t).relu_().mul_(weights[:, :, None]).sum(dim=1)


def indexer_logits_ref(queries: IndexQueries, pool: KeyPool) -> torch.Tensor:
    q = _dequantised(queries.q, queries.scale)
    t, device = q.shape[0], q.device
    j = torch.arange(pool.capacity, device=device)
    slots = _slots(pool, torch.arange(pool.block_table.shape[0], device=device)[:, None], j)  # [R, capacity]
    # The tokens of one request (a prefill) share its keys; otherwise each token gathers its request's.
    shared = _keys_at(pool, slots[0]).T if slots.shape[0] == 1 and t > 1 else None
    token_slots = slots[queries.request.long()] if shared is None else None
    logits = torch.empty(t, pool.capacity, device=device)
    step = _chunk(pool.capacity, q)
    for lo in range(0, t, step):
        rows = slice(lo, lo + step)
        keys_t = shared if shared is not None else _keys_at(pool, token_slots[rows]).transpose(1, 2)
        logits[rows] = _scores(q[rows], queries.weights[rows], keys_t)
    return logits.masked_fill_(j >= queries.visible[:, None], float("-inf"))


def indexer_topk_ref(queries: IndexQueries, pool: KeyPool, k: int) -> torch.Tensor:
    return topk.topk_positions_ref(indexer_logits_ref(queries, pool), k)


def indexer_topk_and_candidates_ref(
    queries: IndexQueries, pool: KeyPool, k: int, block_size: int, topk_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = indexer_logits_ref(queries, pool)
    blocks = candidate_blocks_ref(logits, queries.visible, block_size, topk_blocks)
    return topk.topk_positions_ref(logits, k), blocks


def indexer_topk_in_candidates_ref(
    queries: IndexQueries, pool: KeyPool, k: int, candidates: torch.Tensor, block_size: int
) -> torch.Tensor:
    # Only the candidates' positions are scored, [T, C * block_size]: ascending, the padding's last, so the
    # lower of two tied positions is still the earlier column.
    offsets = torch.arange(block_size, device=candidates.device)
    positions = (candidates.long()[:, :, None] * block_size + offsets).flatten(1)
    inside = (candidates >= 0).repeat_interleave(block_size, dim=1) & (positions < queries.visible[:, None])
    scores = torch.full(positions.shape, float("-inf"), device=positions.device)
    if pool.capacity and positions.numel():
        q = _dequantised(queries.q, queries.scale)
        slots = _slots(pool, queries.request.long()[:, None], torch.where(inside, positions, 0))
        step = _chunk(positions.shape[1], q)
        for lo in range(0, q.shape[0], step):
            rows = slice(lo, lo + step)
            keys_t = _keys_at(pool, slots[rows]).transpose(1, 2)
            scores[rows] = _scores(q[rows], queries.weights[rows], keys_t)
        scores.masked_fill_(~inside, float("-inf"))
    picked = topk.topk_positions_ref(scores, k)
    taken = positions.gather(1, picked.clamp(min=0).long()) if positions.numel() else picked.long()
    return torch.where(picked >= 0, taken, -1).to(torch.int32)


@triton.jit
def _load_query(q_ptr, qs_ptr, w_ptr, t, H, D, QUANT: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr):
    """The query tile ``[HP, DP]`` (int8, or fp32) and the head weights, times the query scale for int8."""
    h = tl.arange(0, HP)
    d = tl.arange(0, DP)
    q = tl.load(
        q_ptr + (t * H + h[:, None]) * D + d[None, :], mask=(h[:, None] < H) & (d[None, :] < D), other=0
    )
    w = tl.load(w_ptr + t * H + h, mask=h < H, other=0.0)
    if QUANT:
        w = w * tl.load(qs_ptr + t * H + h, mask=h < H, other=0.0)
    else:
        q = q.to(tl.float32)
    return q, w


@triton.jit
def _score_keys(
    q,
    w,
    k_ptr,
    ks_ptr,
    table_row,
    block_size,
    pos,
    valid,
    D,
    key_stride,
    scale_stride,
    QUANT: tl.constexpr,
    DP: tl.constexpr,
):
    """Logits of the entries ``pos`` (``-inf`` where not ``valid``) gathered through the block table."""
    # Invalid lanes read table entry 0 and key slot 0 (Ascend drops these gathers' masks).
    safe = tl.where(valid, pos, 0)
    entry = tl.load(table_row + safe // block_size, mask=valid, other=0)  # in-bounds: invalid lanes at 0
    slot = tl.where(valid, entry * block_size + safe % block_size, 0)
    keys = gather_rows(k_ptr, slot, valid, tl.arange(0, DP), D, key_stride, D == DP)
    if QUANT:
        # relu(qs * ks * dot) = qs * ks * relu(dot): both scales are >= 0.
        dots = tl.dot(q, tl.trans(keys), out_dtype=tl.int32).to(tl.float32)
        logits = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0)
        key_scales = tl.load(ks_ptr + slot * scale_stride, mask=valid, other=0.0)  # in-bounds: slot clamped
        logits = logits * key_scales
    else:
        # ieee: the tf32 default on GPUs would cost ~1e-3 relative error in the logits.
        dots = tl.dot(q, tl.trans(keys.to(tl.float32)), input_precision="ieee")
        logits = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0)
    return tl.where(valid, logits, float("-inf"))


@triton.jit(do_not_specialize=["T"])
def _indexer_logits_kernel(
    q_ptr,
    qs_ptr,
    w_ptr,
    k_ptr,
    ks_ptr,
    table_ptr,
    req_ptr,
    vis_ptr,
    out_ptr,
    T,
    H,
    D,
    key_stride,
    scale_stride,
    block_size,
    max_blocks,
    width,
    QUANT: tl.constexpr,
    HP: tl.constexpr,
    DP: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    tiles = tl.cdiv(width, BLOCK_N)
    for task in range(tl.program_id(0), T * tiles, tl.num_programs(0)):
        t = task // tiles
        pos = (task % tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        q, w = _load_query(q_ptr, qs_ptr, w_ptr, t, H, D, QUANT, HP, DP)
        table_row = table_ptr + tl.load(req_ptr + t) * max_blocks
        valid = pos < tl.load(vis_ptr + t)
        logits = _score_keys(
            q, w, k_ptr, ks_ptr, table_row, block_size, pos, valid, D, key_stride, scale_stride, QUANT, DP
        )
        tl.store(out_ptr + t * width + pos, logits, mask=pos < width)


@triton.jit(do_not_specialize=["T", "n_cand"])
def _indexer_topk_kernel(
    q_ptr,
    qs_ptr,
    w_ptr,
    k_ptr,
    ks_ptr,
    table_ptr,
    req_ptr,
    vis_ptr,
    cand_ptr,
    scratch_ptr,
    out_ptr,
    blocks_out_ptr,
    T,
    H,
    D,
    key_stride,
    scale_stride,
    block_size,
    max_blocks,
    n_cand,
    width,
    K,
    KB,
    MODE: tl.constexpr,
    QUANT: tl.constexpr,
    CAND_BLOCK: tl.constexpr,
    HP: tl.constexpr,
    DP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    pid = tl.program_id(0)
    # The scratch row holds a token's logits; in MODE 1 its block maxima follow them.
    stride = width + tl.cdiv(width, CAND_BLOCK) if MODE == 1 else width
    row = scratch_ptr + pid * stride
    for t in range(pid, T, tl.num_programs(0)):
        visible = tl.load(vis_ptr + t)
        q, w = _load_query(q_ptr, qs_ptr, w_ptr, t, H, D, QUANT, HP, DP)
        table_row = table_ptr + tl.load(req_ptr + t) * max_blocks
        n = n_cand * CAND_BLOCK if MODE == 2 else visible
        tl.debug_barrier()  # the previous token's selection has read the scratch row
        for j0 in range(0, n, BLOCK_N):
            c = j0 + tl.arange(0, BLOCK_N)
            if MODE == 2:
                block = tl.load(cand_ptr + t * n_cand + c // CAND_BLOCK, mask=c < n, other=-1)
                pos = block * CAND_BLOCK + c % CAND_BLOCK
                valid = (block >= 0) & (pos < visible)
            else:
                pos = c
                valid = c < n
            logits = _score_keys(
                q, w, k_ptr, ks_ptr, table_row, block_size, pos, valid, D, key_stride, scale_stride, QUANT, DP
            )
            tl.store(row + c, logits, mask=c < n)
        tl.debug_barrier()  # logits are written before any lane selects from them
        if MODE == 2:
            select_row(row, n, K, out_ptr + t * K, cand_ptr + t * n_cand, CAND_BLOCK, BLOCK_S)
        else:
            select_row(row, n, K, out_ptr + t * K, row, 0, BLOCK_S)
        if MODE == 1:
            blocks = row + width
            block_maxima(row, visible, blocks, CAND_BLOCK, BLOCK_S)
            tl.debug_barrier()
            n_blocks = tl.cdiv(visible, CAND_BLOCK)
            select_row(blocks, n_blocks, KB, blocks_out_ptr + t * KB, blocks, 0, BLOCK_S)


def _operands(queries: IndexQueries, pool: KeyPool) -> tuple[torch.Tensor, ...]:
    # Without scales (float path) the kernels never read them; the weights stand in.
    w = queries.weights.contiguous()
    qs = w if queries.scale is None else queries.scale.contiguous()
    ks = w if pool.scale is None else pool.scale  # read at its stride (a column of the cache buffer)
    # The key pool is a column range of the cache buffer: its rows are read at their stride, never copied.
    keys = pool.keys if pool.keys.stride(1) == 1 else pool.keys.contiguous()
    return (
        queries.q.contiguous(),
        qs,
        w,
        keys,
        ks,
        pool.block_table.contiguous(),
        queries.request,
        queries.visible,
    )


# BiSheng cannot split a 16-row int8 score tile between a cube's two vector sub-blocks (the logits kernel
# fails in TileAndBindSubBlock): int8 query tiles pad to 32 heads, the extra rows masked.
_INT8_MIN_HEADS = 32


def _tiles(queries: IndexQueries) -> dict[str, int]:
    _, h, d = queries.q.shape
    quant = queries.q.dtype == torch.int8
    heads = max(h, _INT8_MIN_HEADS) if quant else h
    return {"QUANT": quant, "HP": runtime.dot_dim(heads), "DP": runtime.dot_dim(d)}


def indexer_logits_triton(queries: IndexQueries, pool: KeyPool) -> torch.Tensor:
    t, h, d = queries.q.shape
    width = pool.capacity
    out = torch.empty((t, width), dtype=torch.float32, device=queries.q.device)
    if t > 0 and width > 0:
        quant = queries.q.dtype == torch.int8
        tuned = _LOGITS_TUNED[quant]
        operands = _operands(queries, pool)
        tuned[lambda meta: tuned.grid(t * triton.cdiv(width, meta["BLOCK_N"]))](
            *operands,
            out,
            t,
            h,
            d,
            operands[3].stride(0),
            operands[4].stride(0),
            pool.block_size,
            pool.block_table.shape[1],
            width,
            **_tiles(queries),
        )
    return out


def _launch_topk(
    queries: IndexQueries,
    pool: KeyPool,
    k: int,
    mode: int,
    cand_block: int = 1,
    topk_blocks: int = 0,
    candidates: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    t, h, d = queries.q.shape
    device = queries.q.device
    out = torch.empty((t, k), dtype=torch.int32, device=device)
    blocks_out = torch.empty((t, topk_blocks), dtype=torch.int32, device=device)
    n_cand = 0 if candidates is None else candidates.shape[1]
    width = n_cand * cand_block if mode == _CONSUMER else pool.capacity
    if t == 0 or (k == 0 and topk_blocks == 0):
        return out, blocks_out
    quant = queries.q.dtype == torch.int8
    tuned = _TOPK_TUNED[quant]
    grid = tuned.grid(t)
    stride = width + (triton.cdiv(width, cand_block) if mode == _SOURCE else 0)
    scratch = torch.empty((grid[0], max(1, stride)), dtype=torch.float32, device=device)
    cand = out if candidates is None else candidates.contiguous()  # never read outside MODE 2
    operands = _operands(queries, pool)
    tuned[grid](
        *operands,
        cand,
        scratch,
        out,
        blocks_out,
        t,
        h,
        d,
        operands[3].stride(0),
        operands[4].stride(0),
        pool.block_size,
        pool.block_table.shape[1],
        n_cand,
        width,
        k,
        topk_blocks,
        MODE=mode,
        CAND_BLOCK=cand_block,
        **_tiles(queries),
    )
    return out, blocks_out


def score_split(tokens: int) -> bool:
    """Whether one task per token would leave cores idle (decode): then the logits kernel scores (token, key
    tile) tasks over every core and the top-k kernels select from its rows."""
    return tokens < runtime.num_aicore()


def _scored_then_selected(queries: IndexQueries, split: bool | None, picks: int) -> bool:
    # Nothing to pick launches nothing (the fused launcher returns before launching).
    return picks > 0 and (score_split(queries.q.shape[0]) if split is None else split)


def indexer_topk_triton(
    queries: IndexQueries, pool: KeyPool, k: int, split: bool | None = None
) -> torch.Tensor:
    """``split`` forces the scoring split or the fused kernel; by default ``score_split`` decides."""
    if _scored_then_selected(queries, split, k):
        return topk.topk_positions_triton(indexer_logits_triton(queries, pool), k)
    return _launch_topk(queries, pool, k, _PLAIN)[0]


def indexer_topk_and_candidates_triton(
    queries: IndexQueries, pool: KeyPool, k: int, block_size: int, topk_blocks: int, split: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    if _scored_then_selected(queries, split, k + topk_blocks):
        logits = indexer_logits_triton(queries, pool)
        blocks = topk.candidate_blocks_triton(logits, queries.visible, block_size, topk_blocks)
        return topk.topk_positions_triton(logits, k), blocks
    return _launch_topk(queries, pool, k, _SOURCE, block_size, topk_blocks)


def indexer_topk_in_candidates_triton(
    queries: IndexQueries, pool: KeyPool, k: int, candidates: torch.Tensor, block_size: int
) -> torch.Tensor:
    return _launch_topk(queries, pool, k, _CONSUMER, block_size, candidates=candidates)[0]


# Footprints at the model's tiles (H = 64, D = 128 padded): the query tile, the key tile and its
# transpose (dot operands: int8 as loaded, fp32 after the cast of the float path) with the key mask,
# then the [HP, BLOCK_N] dot result with its ReLU'd and weighted copies and a few [BLOCK_N] vectors.
# The top-k kernel adds the selection tiles and, for the candidate source, the block-maximum tiles.
_HP, _DP = INDEXER_MAX_HEADS, INDEXER_MAX_DIM


def _score_ub(block_n: int, operand_bytes: int) -> int:
    return (_HP + 2 * block_n) * _DP * operand_bytes + block_n * _DP + 4 * (3 * _HP * block_n + 8 * block_n)


def _config(block_n: int, operand_bytes: int, block_s: int = 0, multibuffer: bool = True) -> TuneConfig:
    params, ub = {"BLOCK_N": block_n}, _score_ub(block_n, operand_bytes)
    if block_s:  # the top-k kernel: selection tiles, plus the candidate source's block-maximum tiles
        params["BLOCK_S"] = block_s
        ub += topk.select_ub(block_s) + 4 * 8 * block_s
    return TuneConfig(params, ub, multibuffer)


_LOGITS_FLOAT = (_config(16, 4), _config(64, 4, multibuffer=False))
_LOGITS_INT8 = (_config(32, 1, multibuffer=False), _config(64, 1, multibuffer=False))
_TOPK_FLOAT = (_config(16, 4, 512, multibuffer=False), _config(32, 4, 512, multibuffer=False))
_TOPK_INT8 = (_config(32, 1, 512, multibuffer=False), _config(64, 1, 512, multibuffer=False))

_OPERANDS = ("q_ptr", "qs_ptr", "w_ptr", "k_ptr", "ks_ptr")
_INDEX = {"table_ptr": "*i32", "req_ptr": "*i32", "vis_ptr": "*i32"}


def _signature(x: str, outputs: dict[str, str], ints: tuple[str, ...]) -> dict[str, str]:
    operands = dict(zip(_OPERANDS, (x, "*fp32", "*fp32", x, "*fp32"), strict=True))
    return {**operands, **_INDEX, **outputs, **dict.fromkeys(ints, "i32")}


_LOGITS_INTS = ("T", "H", "D", "key_stride", "scale_stride", "block_size", "max_blocks", "width")
_TOPK_OUT = {"cand_ptr": "*i32", "scratch_ptr": "*fp32", "out_ptr": "*i32", "blocks_out_ptr": "*i32"}
_TOPK_INTS = (*_LOGITS_INTS[:7], "n_cand", "width", "K", "KB")
_FIXED = {"HP": _HP, "DP": _DP}
_VARIANTS = ((("*fp32", "*bf16"), _LOGITS_FLOAT, _TOPK_FLOAT), (("*i8",), _LOGITS_INT8, _TOPK_INT8))

_KINDS = ("float", "int8")  # by QUANT
_LOGITS_TUNED = tuple(
    tuning.TunedKernel(
        _indexer_logits_kernel,
        configs,
        ["H", "D"],
        f"logits_{_KINDS[quant]}",
        variants=(
            Variant(
                {"QUANT": quant, **_FIXED},
                tuple(_signature(x, {"out_ptr": "*fp32"}, _LOGITS_INTS) for x in xs),
            ),
        ),
        uses_cube=True,
    )
    for quant, (xs, configs, _) in enumerate(_VARIANTS)
)
_TOPK_TUNED = tuple(
    tuning.TunedKernel(
        _indexer_topk_kernel,
        configs,
        ["H", "D", "MODE", "CAND_BLOCK"],
        f"topk_{_KINDS[quant]}",
        variants=tuple(
            Variant(
                {"MODE": mode, "QUANT": quant, "CAND_BLOCK": 8, **_FIXED},
                tuple(_signature(x, _TOPK_OUT, _TOPK_INTS) for x in xs),
            )
            for mode in (_PLAIN, _SOURCE, _CONSUMER)
        ),
        uses_cube=True,
    )
    for quant, (xs, _, configs) in enumerate(_VARIANTS)
)
KERNELS = (*_LOGITS_TUNED, *_TOPK_TUNED)
