"""Every public operator as a torch custom op (``torch.ops.dsv4.*``), so a forward traces as one graph.

Each op takes the operator's arguments flattened to tensors and scalars (the dataclasses ``KVPool``,
``IndexQueries``, ``KeyPool``, ``CompressBatch``, ``CompressorStates``, ``CompressorParams``,
``QuantWeight``, ``RoutedExperts`` and ``HashTables`` taken apart), runs the public operator (its
Triton kernel on an NPU or a GPU, its torch reference on the CPU) and has a fake implementation
that gives the outputs' shapes and dtypes without running it. ``compress`` declares what it writes
(its states and output rows), the cache writes ``store_rows`` / ``store_quantized`` their pools.

The functions below are what the model calls. Outside tracing they call the operator directly:
the dispatcher's round trip costs several microseconds a call, which the CPU path feels; under
``make_fx``, ``torch.export`` or dynamo they call the op, which the trace keeps as one node. Within
``inline_references`` a trace records the CPU references themselves, aten op by aten op; ``RECORDED``
is the decomposition table such a trace takes (aten ops whose meta function refuses what their CPU
kernel runs, recorded as ops of ours).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from triton_kernels import (
    compressor,
    engram,
    indexer,
    kv_store,
    mhc,
    paging,
    quant,
    rmsnorm,
    rope,
    router,
    runtime,
    sparse_attn,
)
from triton_kernels import engram_gate as gating
from triton_kernels import moe_gemm as moe
from triton_kernels import quant_matmul as qmm
from triton_kernels.compressor import CompressBatch, CompressorParams, CompressorStates
from triton_kernels.engram import HashTables
from triton_kernels.indexer import IndexQueries, KeyPool
from triton_kernels.kv_store import QuantizedRows
from triton_kernels.moe_gemm import RoutedExperts
from triton_kernels.quant_matmul import QuantWeight
from triton_kernels.sparse_attn import KVPool

Tensor = torch.Tensor
_inline = False  # inline_references() is active


@contextlib.contextmanager
def inline_references() -> Iterator[None]:
    """While it lasts, a trace records each CPU reference's own aten ops instead of one node per operator
    (a CPU graph: the replay then runs no Python), except for the ops it keeps ``whole``: ``compress``,
    whose reference finds the closed windows on the host (a graph would compute a window per token, each
    ``ratio`` rows wide), and the GEMMs over quantised weights, whose references decode them in thousands
    of ops a call."""
    global _inline
    _inline, before = True, _inline
    try:
        yield
    finally:
        _inline = before


def tracing(whole: bool = False) -> bool:
    """This call is recorded as one node: a trace runs, and it inlines no reference or keeps this one
    ``whole``."""
    return runtime.tracing() and (not _inline or whole)


_LIB = torch.library.Library("dsv4", "DEF")


@dataclass(frozen=True)
class _Op:
    """``torch.ops.dsv4.<name>``: calls it, and ``register_fake`` gives it its fake implementation."""

    op: torch._ops.OpOverload

    def __call__(self, *args: Any) -> Any:
        return self.op(*args)

    def register_fake(self, fake: Callable) -> Callable:
        return torch.library.register_fake(self.op, fake, lib=_LIB)


def _op(name: str, mutates: tuple[str, ...] = ()) -> Callable[[Callable], _Op]:
    """Defines ``dsv4::<name>`` from the function's signature, the function running it on every backend.
    A plain library op: a replayed graph calls it through the dispatcher in microseconds (``custom_op``
    adds its autograd and view handling, about 100 us a call)."""

    def define(fn: Callable) -> _Op:
        _LIB.define(name + torch.library.infer_schema(fn, mutates_args=mutates))
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        return _Op(getattr(torch.ops.dsv4, name).default)

    return define


def _like(x: Tensor, *shape: int, dtype: torch.dtype | None = None) -> Tensor:
    return x.new_empty(shape, dtype=dtype or x.dtype)


# --- norms, rope, mHC: shapes follow the input -----------------------------------------------------


@_op("rms_norm")
def _rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    return rmsnorm.rms_norm(x, weight, eps)


@_rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    return _rms_norm(x, weight, eps) if tracing() else rmsnorm.rms_norm(x, weight, eps)


@_op("apply_rope", ("cache",))
def _apply_rope(
    x: Tensor,
    positions: Tensor,
    inv_freq: Tensor,
    inverse: bool,
    norm_eps: float | None,
    norm_weight: Tensor | None,
    cache: Tensor | None,
    slots: Tensor | None,
) -> Tensor:
    return rope.apply_rope(x, positions, inv_freq, inverse, norm_eps, norm_weight, cache, slots)


@_apply_rope.register_fake
def _(x, positions, inv_freq, inverse, norm_eps, norm_weight, cache, slots):
    return torch.empty_like(x)


def apply_rope(
    x: Tensor,
    positions: Tensor,
    inv_freq: Tensor,
    inverse: bool = False,
    norm_eps: float | None = None,
    norm_weight: Tensor | None = None,
    cache: Tensor | None = None,
    slots: Tensor | None = None,
) -> Tensor:
    op = _apply_rope if tracing() else rope.apply_rope
    return op(x, positions, inv_freq, inverse, norm_eps, norm_weight, cache, slots)


@_op("hc_mix")
def _hc_mix(
    x: Tensor,
    fn: Tensor,
    base: Tensor,
    scale: Tensor,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    input_weight: Tensor | None,
    input_eps: float,
    carry: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    pre, post, comb, h = mhc.hc_mix(
        x, fn, base, scale, norm_eps=norm_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters,
        input_weight=input_weight, input_eps=input_eps, carry=carry,
    )  # fmt: skip
    return pre, post, comb, h


@_hc_mix.register_fake
def _(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, input_weight, input_eps, carry):
    t, n, d = x.shape
    f32 = torch.float32
    return _like(x, t, n, dtype=f32), _like(x, t, n, dtype=f32), _like(x, t, n, n, dtype=f32), _like(x, t, d)


def hc_mix(
    x: Tensor,
    fn: Tensor,
    base: Tensor,
    scale: Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    input_weight: Tensor | None,
    input_eps: float,
    carry: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if tracing():
        return _hc_mix(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, input_weight, input_eps, carry)
    return mhc.hc_mix(
        x, fn, base, scale, norm_eps=norm_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters,
        input_weight=input_weight, input_eps=input_eps, carry=carry,
    )  # fmt: skip


@_op("hc_head_coeffs")
def _hc_head_coeffs(
    x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, norm_eps: float, hc_eps: float
) -> Tensor:
    return mhc.hc_head_coeffs(x, fn, base, scale, norm_eps=norm_eps, hc_eps=hc_eps)


@_hc_head_coeffs.register_fake
def _(x, fn, base, scale, norm_eps, hc_eps):
    return _like(x, *x.shape[:2], dtype=torch.float32)


def hc_head_coeffs(
    x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, *, norm_eps: float, hc_eps: float
) -> Tensor:
    if tracing():
        return _hc_head_coeffs(x, fn, base, scale, norm_eps, hc_eps)
    return mhc.hc_head_coeffs(x, fn, base, scale, norm_eps=norm_eps, hc_eps=hc_eps)


@_op("hc_collapse")
def _hc_collapse(x: Tensor, pre: Tensor, norm_weight: Tensor | None, norm_eps: float | None) -> Tensor:
    return mhc.hc_collapse(x, pre, norm_weight, norm_eps)


@_hc_collapse.register_fake
def _(x, pre, norm_weight, norm_eps):
    return _like(x, x.shape[0], x.shape[2])


def hc_collapse(
    x: Tensor, pre: Tensor, norm_weight: Tensor | None = None, norm_eps: float | None = None
) -> Tensor:
    op = _hc_collapse if tracing() else mhc.hc_collapse
    return op(x, pre, norm_weight, norm_eps)


@_op("hc_update")
def _hc_update(x: Tensor, f: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    return mhc.hc_update(x, f, post, comb)


@_hc_update.register_fake
def _(x, f, post, comb):
    return torch.empty_like(x)


def hc_update(x: Tensor, f: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    return _hc_update(x, f, post, comb) if tracing() else mhc.hc_update(x, f, post, comb)


# --- indexer: queries and key pool taken apart ---------------------------------------------------


def _queries(
    q: Tensor, weights: Tensor, request: Tensor, visible: Tensor, scale: Tensor | None
) -> IndexQueries:
    return IndexQueries(q, weights, request, visible, scale)


def _query_args(queries: IndexQueries) -> tuple:
    return queries.q, queries.weights, queries.request, queries.visible, queries.scale


def _pool_args(pool: KeyPool) -> tuple:
    return pool.keys, pool.block_table, pool.block_size, pool.scale


@_op("indexer_logits")
def _indexer_logits(
    q: Tensor,
    weights: Tensor,
    request: Tensor,
    visible: Tensor,
    q_scale: Tensor | None,
    keys: Tensor,
    table: Tensor,
    block_size: int,
    k_scale: Tensor | None,
) -> Tensor:
    queries = _queries(q, weights, request, visible, q_scale)
    return indexer.indexer_logits(queries, KeyPool(keys, table, block_size, k_scale))


@_indexer_logits.register_fake
def _(q, weights, request, visible, q_scale, keys, table, block_size, k_scale):
    return _like(weights, q.shape[0], table.shape[1] * block_size)


def indexer_logits(queries: IndexQueries, pool: KeyPool) -> Tensor:
    if tracing():
        return _indexer_logits(*_query_args(queries), *_pool_args(pool))
    return indexer.indexer_logits(queries, pool)


@_op("indexer_topk")
def _indexer_topk(
    q: Tensor,
    weights: Tensor,
    request: Tensor,
    visible: Tensor,
    q_scale: Tensor | None,
    keys: Tensor,
    table: Tensor,
    block_size: int,
    k_scale: Tensor | None,
    k: int,
) -> Tensor:
    queries = _queries(q, weights, request, visible, q_scale)
    return indexer.indexer_topk(queries, KeyPool(keys, table, block_size, k_scale), k)


@_indexer_topk.register_fake
def _(q, weights, request, visible, q_scale, keys, table, block_size, k_scale, k):
    return _like(q, q.shape[0], k, dtype=torch.int32)


def indexer_topk(queries: IndexQueries, pool: KeyPool, k: int) -> Tensor:
    if tracing():
        return _indexer_topk(*_query_args(queries), *_pool_args(pool), k)
    return indexer.indexer_topk(queries, pool, k)


@_op("indexer_topk_and_candidates")
def _indexer_topk_and_candidates(
    q: Tensor,
    weights: Tensor,
    request: Tensor,
    visible: Tensor,
    q_scale: Tensor | None,
    keys: Tensor,
    table: Tensor,
    block_size: int,
    k_scale: Tensor | None,
    k: int,
    candidate_block: int,
    topk_blocks: int,
) -> tuple[Tensor, Tensor]:
    queries = _queries(q, weights, request, visible, q_scale)
    pool = KeyPool(keys, table, block_size, k_scale)
    picked, blocks = indexer.indexer_topk_and_candidates(queries, pool, k, candidate_block, topk_blocks)
    return picked, blocks


@_indexer_topk_and_candidates.register_fake
def _(
    q, weights, request, visible, q_scale, keys, table, block_size, k_scale, k, candidate_block, topk_blocks
):
    t = q.shape[0]
    return _like(q, t, k, dtype=torch.int32), _like(q, t, topk_blocks, dtype=torch.int32)


def indexer_topk_and_candidates(
    queries: IndexQueries, pool: KeyPool, k: int, block_size: int, topk_blocks: int
) -> tuple[Tensor, Tensor]:
    if tracing():
        return _indexer_topk_and_candidates(
            *_query_args(queries), *_pool_args(pool), k, block_size, topk_blocks
        )
    return indexer.indexer_topk_and_candidates(queries, pool, k, block_size, topk_blocks)


@_op("indexer_topk_in_candidates")
def _indexer_topk_in_candidates(
    q: Tensor,
    weights: Tensor,
    request: Tensor,
    visible: Tensor,
    q_scale: Tensor | None,
    keys: Tensor,
    table: Tensor,
    block_size: int,
    k_scale: Tensor | None,
    k: int,
    candidates: Tensor,
    candidate_block: int,
) -> Tensor:
    queries = _queries(q, weights, request, visible, q_scale)
    pool = KeyPool(keys, table, block_size, k_scale)
    return indexer.indexer_topk_in_candidates(queries, pool, k, candidates, candidate_block)


@_indexer_topk_in_candidates.register_fake
def _(
    q, weights, request, visible, q_scale, keys, table, block_size, k_scale, k, candidates, candidate_block
):
    return _like(q, q.shape[0], k, dtype=torch.int32)


def indexer_topk_in_candidates(
    queries: IndexQueries, pool: KeyPool, k: int, candidates: Tensor, block_size: int
) -> Tensor:
    if tracing():
        return _indexer_topk_in_candidates(
            *_query_args(queries), *_pool_args(pool), k, candidates, block_size
        )
    return indexer.indexer_topk_in_candidates(queries, pool, k, candidates, block_size)


# --- sparse attention: the pools as parallel lists -------------------------------------------------


@_op("sparse_attention")
def _sparse_attention(
    q: Tensor,
    kv: list[Tensor],
    indices: list[Tensor],
    kv_scales: list[Tensor | None],
    kv_ropes: list[Tensor | None],
    sink: Tensor,
    scale: float,
    positions: Tensor | None,
    inv_freq: Tensor | None,
) -> tuple[Tensor, Tensor]:
    pools = [KVPool(*parts) for parts in zip(kv, indices, kv_scales, kv_ropes, strict=True)]
    out, lse = sparse_attn.sparse_attention(q, pools, sink, scale, positions, inv_freq)
    return out, lse


@_sparse_attention.register_fake
def _(q, kv, indices, kv_scales, kv_ropes, sink, scale, positions, inv_freq):
    return torch.empty_like(q), _like(q, *q.shape[:2], dtype=torch.float32)


def sparse_attention(
    q: Tensor,
    pools: Sequence[KVPool],
    sink: Tensor,
    scale: float,
    positions: Tensor | None = None,
    inv_freq: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    if tracing():
        parts = [
            [p.kv for p in pools],
            [p.indices for p in pools],
            [p.scale for p in pools],
            [p.rope for p in pools],
        ]
        return _sparse_attention(q, *parts, sink, scale, positions, inv_freq)
    return sparse_attn.sparse_attention(q, pools, sink, scale, positions, inv_freq)


# --- compressor: writes its states and output rows --------------------------------------------------


@_op("compress", ("buffer_kv", "buffer_gate", "overlap_kv", "overlap_gate", "out", "out_scale"))
def _compress(
    kv: Tensor,
    gate: Tensor | None,
    cu_seqlens: Tensor,
    start: Tensor,
    state_ids: Tensor,
    slots: Tensor,
    request: Tensor,
    order: Tensor,
    buffer_kv: Tensor,
    buffer_gate: Tensor,
    overlap_kv: Tensor | None,
    overlap_gate: Tensor | None,
    ratio: int,
    overlap: bool,
    norm_weight: Tensor,
    eps: float,
    ape: Tensor | None,
    inv_freq: Tensor | None,
    out: Tensor,
    out_scale: Tensor | None,
) -> None:
    batch = CompressBatch(cu_seqlens, start, state_ids, slots, request, order)
    states = CompressorStates(buffer_kv, buffer_gate, overlap_kv, overlap_gate)
    params = CompressorParams(ratio, overlap, norm_weight, eps, ape, inv_freq)
    compressor.compress_validated(kv, gate, batch, states, params, out, out_scale)


@_compress.register_fake
def _(kv, gate, cu_seqlens, start, state_ids, slots, request, order, buffer_kv, buffer_gate, *rest):
    return None


def compress(
    kv: Tensor,
    gate: Tensor | None,
    batch: CompressBatch,
    states: CompressorStates,
    params: CompressorParams,
    out: Tensor,
    out_scale: Tensor | None = None,
) -> None:
    """``triton_kernels.compressor.compress`` with a state (the model's calls always carry one)."""
    if not tracing(whole=True):
        return compressor.compress(kv, gate, batch, states, params, out, out_scale)
    compressor.validate(kv, gate, batch, states, params, out, out_scale)  # once, while the trace records
    b, s, p = batch, states, params
    _compress(
        kv, gate, b.cu_seqlens, b.start, b.state_ids, b.slots, b.request, b.order, s.buffer_kv, s.buffer_gate,
        s.overlap_kv, s.overlap_gate, p.ratio, p.overlap, p.norm_weight, p.eps, p.ape, p.inv_freq, out,
        out_scale,
    )  # fmt: skip
    return None


# --- the paged cache: slots, and the writes into the pools ----------------------------------------


@_op("block_slots")
def _block_slots(table: Tensor, rows: Tensor, numbers: Tensor, per_block: int) -> Tensor:
    return paging.block_slots(table, rows, numbers, per_block)


@_block_slots.register_fake
def _(table, rows, numbers, per_block):
    return torch.empty_like(numbers, dtype=torch.int32)


def block_slots(table: Tensor, rows: Tensor, numbers: Tensor, per_block: int) -> Tensor:
    if tracing():
        return _block_slots(table, rows, numbers, per_block)
    return paging.block_slots(table, rows, numbers, per_block)


@_op("store_rows", ("pool",))
def _store_rows(rows: Tensor, slots: Tensor, pool: Tensor) -> None:
    kv_store.store_rows(rows, slots, pool)


@_store_rows.register_fake
def _(rows, slots, pool):
    return None


def store_rows(rows: Tensor, slots: Tensor, pool: Tensor) -> None:
    return _store_rows(rows, slots, pool) if tracing() else kv_store.store_rows(rows, slots, pool)


@_op("store_quantized", ("codes", "scale", "rope"))
def _store_quantized(rows: Tensor, slots: Tensor, codes: Tensor, scale: Tensor, rope: Tensor | None) -> None:
    kv_store.store_quantized(rows, slots, QuantizedRows(codes, scale, rope))


@_store_quantized.register_fake
def _(rows, slots, codes, scale, rope):
    return None


def store_quantized(rows: Tensor, slots: Tensor, cache: QuantizedRows) -> None:
    if not tracing():
        return kv_store.store_quantized(rows, slots, cache)
    return _store_quantized(rows, slots, cache.codes, cache.scale, cache.rope)


# --- MoE routing ----------------------------------------------------------------------------------


@_op("route")
def _route(
    logits: Tensor,
    bias: Tensor | None,
    hashed: Tensor | None,
    k: int,
    temp: float,
    normalize: bool,
    scaling: float,
) -> tuple[Tensor, Tensor]:
    picked, weights = router.route(logits, bias, hashed, k, temp, normalize, scaling)
    return picked.clone() if hashed is not None else picked, weights  # an op's outputs alias no input


@_route.register_fake
def _(logits, bias, hashed, k, temp, normalize, scaling):
    return _like(logits, logits.shape[0], k, dtype=torch.int64), _like(logits, logits.shape[0], k)


def route(
    logits: Tensor,
    bias: Tensor | None,
    hashed: Tensor | None,
    k: int,
    temp: float,
    normalize: bool,
    scaling: float,
) -> tuple[Tensor, Tensor]:
    op = _route if tracing() else router.route
    return op(logits, bias, hashed, k, temp, normalize, scaling)


@_op("swiglu")
def _swiglu(gate: Tensor, up: Tensor, limit: float | None) -> Tensor:
    return moe.swiglu(gate, up, limit)


@_swiglu.register_fake
def _(gate, up, limit):
    return torch.empty_like(gate)


def swiglu(gate: Tensor, up: Tensor, limit: float | None) -> Tensor:
    return _swiglu(gate, up, limit) if tracing() else moe.swiglu(gate, up, limit)


# --- int8 quantisation, GEMMs -----------------------------------------------------------------------


@_op("quantize_int8")
def _quantize_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    q, scale = quant.quantize_int8(x)
    return q, scale


@_quantize_int8.register_fake
def _(x):
    return torch.empty_like(x, dtype=torch.int8), _like(x, *x.shape[:-1], dtype=torch.float32)


def quantize_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    return _quantize_int8(x) if tracing() else quant.quantize_int8(x)


def _weight_args(w: QuantWeight) -> tuple:
    return w.format, w.data, w.scale, w.block, w.in_features


@_op("quant_matmul")
def _quant_matmul(x: Tensor, fmt: str, data: Tensor, scale: Tensor, block: int, in_features: int) -> Tensor:
    return qmm.quant_matmul(x, QuantWeight(fmt, data, scale, block, in_features))


@_quant_matmul.register_fake
def _(x, fmt, data, scale, block, in_features):
    out = data.shape[-2] * (2 if fmt == qmm.INT4 else 1)
    return _like(x, x.shape[0], out)


def quant_matmul(x: Tensor, weight: QuantWeight) -> Tensor:
    if tracing(whole=weight.format != qmm.DENSE):
        return _quant_matmul(x, *_weight_args(weight))
    return qmm.quant_matmul(x, weight)


@_op("moe_gemm")
def _moe_gemm(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    fmt: str,
    block: int,
    w1: Tensor,
    w1_scale: Tensor,
    w3: Tensor,
    w3_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    hidden: int,
    inter: int,
    swiglu_limit: float | None,
    shared: Tensor | None,
) -> Tensor:
    experts = RoutedExperts(
        QuantWeight(fmt, w1, w1_scale, block, hidden),
        QuantWeight(fmt, w3, w3_scale, block, hidden),
        QuantWeight(fmt, w2, w2_scale, block, inter),
        swiglu_limit,
    )
    return moe.moe_gemm(x, topk_ids, topk_weights, experts, shared)


@_moe_gemm.register_fake
def _(x, topk_ids, topk_weights, fmt, block, w1, w1_scale, w3, w3_scale, w2, w2_scale, hidden, inter, limit,
      shared):  # fmt: skip
    return torch.empty_like(x, dtype=x.dtype if shared is None else torch.float32)


def moe_gemm(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor, experts: RoutedExperts, shared: Tensor | None = None
) -> Tensor:
    if not tracing(whole=not moe.dense_fp32(experts)):
        return moe.moe_gemm(x, topk_ids, topk_weights, experts, shared)
    w1, w3, w2 = experts.w1, experts.w3, experts.w2
    if (w1.format, w1.block) != (w2.format, w2.block):
        raise ValueError(f"w2: format {w2.format} / block {w2.block} must be w1's ({w1.format} / {w1.block})")
    return _moe_gemm(
        x, topk_ids, topk_weights, w1.format, w1.block, w1.data, w1.scale, w3.data, w3.scale, w2.data,
        w2.scale, experts.hidden, experts.inter, experts.swiglu_limit, shared,
    )  # fmt: skip


@_op("grouped_mm")
def _grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    return torch._grouped_mm(a, b, offs=offs)


@_grouped_mm.register_fake
def _(a, b, offs):
    return _like(a, a.shape[0], b.shape[-1])


def _record_grouped_mm(
    a: Tensor, b: Tensor, offs: Tensor | None = None, bias: Tensor | None = None, out_dtype=None
) -> Tensor:
    """aten's ``_grouped_mm`` of the fp32 experts (``[M, K]`` rows, ``[G, K, N]`` weights, ``offs``) as our
    op: its CPU kernel runs fp32, its meta function takes bf16 only. Other calls are left to aten."""
    if offs is None or bias is not None or out_dtype not in (None, a.dtype) or (a.dim(), b.dim()) != (2, 3):
        return NotImplemented
    return _grouped_mm(a, b, offs)


RECORDED = {torch.ops.aten._grouped_mm.default: _record_grouped_mm}


# --- Engram ---------------------------------------------------------------------------------------


def _table_args(tables: HashTables) -> tuple:
    return tables.multipliers, tables.limbs, tables.primes, tables.offsets, tables.pad


@_op("engram_hash")
def _engram_hash(
    cids: Tensor,
    n_history: int,
    multipliers: Tensor,
    limbs: Tensor,
    primes: Tensor,
    offsets: Tensor,
    pad: int,
) -> Tensor:
    # The reference builds the ids layer-major: the op's output is contiguous, as its fake one.
    return engram.engram_hash(
        cids, n_history, HashTables(multipliers, limbs, primes, offsets, pad)
    ).contiguous()


@_engram_hash.register_fake
def _(cids, n_history, multipliers, limbs, primes, offsets, pad):
    return _like(cids, cids.shape[0] - n_history, *primes.shape, dtype=torch.int32)


def engram_hash(cids: Tensor, n_history: int, tables: HashTables) -> Tensor:
    if tracing():
        return _engram_hash(cids, n_history, *_table_args(tables))
    return engram.engram_hash(cids, n_history, tables)


@_op("engram_gate")
def _engram_gate(
    x: Tensor, kv: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, dead: Tensor | None
) -> Tensor:
    return gating.engram_gate(x, kv, q_weight, k_weight, eps, dead)


@_engram_gate.register_fake
def _(x, kv, q_weight, k_weight, eps, dead):
    return torch.empty_like(x)


def engram_gate(
    x: Tensor, kv: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, dead: Tensor | None = None
) -> Tensor:
    op = _engram_gate if tracing() else gating.engram_gate
    return op(x, kv, q_weight, k_weight, eps, dead)


@_op("engram_gather")
def _engram_gather(table: Tensor, ids: Tensor, device: str) -> Tensor:
    return engram.engram_gather(table, ids, device)


@_engram_gather.register_fake
def _(table, ids, device):
    return table.new_empty((*ids.shape, table.shape[1]), device=device)


def engram_gather(table: Tensor, ids: Tensor, device: torch.device | str) -> Tensor:
    if tracing():
        return _engram_gather(table, ids, str(device))
    return engram.engram_gather(table, ids, device)
