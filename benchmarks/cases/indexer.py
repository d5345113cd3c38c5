"""Lightning indexer, top-k and int8 quantisation cases.

Each request's indexer keys are ``context // ratio`` compressed entries (the smallest compress ratio
of the model) in a paged pool of 64-slot blocks, shuffled over the pool; its new tokens see the
entries their positions have closed. Queries have the model's indexer heads and head dim, ``k`` is its
``index_topk`` and, for V4.1, the candidate source and consumer keep ``candidate_topk_blocks`` blocks of
``candidate_block_size``. Traffic counts each request's visible keys (and scales) once.
"""

from __future__ import annotations

import torch
import triton

from benchmarks.cases.case import Case, elements_bytes
from benchmarks.workload import Phase
from model.config import ModelConfig
from triton_kernels import indexer, quant, topk
from triton_kernels.indexer import IndexQueries, KeyPool

_BLOCK_SIZE = 64


def _ratio(cfg: ModelConfig) -> int:
    return min(r for r in cfg.compress_ratios if r)


def _inputs(
    cfg: ModelConfig, phase: Phase, dev: torch.device, dtype: torch.dtype, int8: bool
) -> tuple[IndexQueries, KeyPool]:
    gen = torch.Generator(device=dev).manual_seed(0)
    heads, dim, reqs = cfg.index_n_heads, cfg.index_head_dim, phase.requests
    blocks = triton.cdiv(max(1, phase.context // _ratio(cfg)), _BLOCK_SIZE)
    table = torch.randperm(reqs * blocks, generator=gen, device=dev).int().view(reqs, blocks)
    keys = torch.randn(reqs * blocks * _BLOCK_SIZE, dim, generator=gen, device=dev)
    q = torch.randn(phase.total, heads, dim, generator=gen, device=dev)
    weights = torch.randn(phase.total, heads, generator=gen, device=dev) * (heads * dim) ** -0.5
    request = torch.arange(reqs, device=dev).repeat_interleave(phase.tokens).int()
    positions = phase.context - phase.tokens + torch.arange(phase.tokens, device=dev).repeat(reqs)
    visible = ((positions + 1) // _ratio(cfg)).int()
    if not int8:
        return IndexQueries(q.to(dtype), weights, request, visible), KeyPool(
            keys.to(dtype), table, _BLOCK_SIZE
        )
    (q8, qs), (k8, ks) = quant.quantize_int8_ref(q), quant.quantize_int8_ref(keys)
    return IndexQueries(q8, weights, request, visible, qs), KeyPool(k8, table, _BLOCK_SIZE, ks)


def _traffic(queries: IndexQueries, pool: KeyPool, out_elems: int, keys: int | None = None) -> int:
    """Each request's visible keys (+ scales) once, unless ``keys`` says how many are read; queries,
    weights, 4-byte outputs."""
    per_key = pool.keys.shape[1] * pool.keys.element_size() + (4 if pool.scale is not None else 0)
    seen = torch.zeros(pool.block_table.shape[0], dtype=torch.long, device=queries.visible.device)
    seen = seen.scatter_reduce(0, queries.request.long(), queries.visible.long(), "amax")
    read = int(seen.sum()) if keys is None else keys
    return read * per_key + elements_bytes(queries.q, queries.weights) + 4 * out_elems


def indexer_cases(cfg: ModelConfig, phase: Phase, dev: torch.device, dtype: torch.dtype) -> list[Case]:
    tag = "bf16" if dtype == torch.bfloat16 else "fp32"
    return _variant(cfg, phase, dev, dtype, tag) + _variant(cfg, phase, dev, dtype, "int8")


def _variant(cfg: ModelConfig, phase: Phase, dev: torch.device, dtype: torch.dtype, tag: str) -> list[Case]:
    int8 = tag == "int8"
    queries, pool = _inputs(cfg, phase, dev, dtype, int8)
    k, cand_block, keep = cfg.index_topk, cfg.candidate_block_size, cfg.candidate_topk_blocks
    t, (h, d) = phase.total, queries.q.shape[1:]
    scored = 2 * h * d * int(queries.visible.sum())  # every visible key against every head

    def case(name: str, ref: object, kernel: object, traffic: int, flops: int = scored) -> Case:
        return Case("indexer", f"{name} {tag}", phase, ref, kernel, traffic, flops, int8)

    cases = [
        case(
            "indexer_logits",
            lambda: indexer.indexer_logits_ref(queries, pool),
            lambda: indexer.indexer_logits_triton(queries, pool),
            _traffic(queries, pool, t * pool.capacity),
        ),
        case(
            "indexer_topk (fused)",
            lambda: indexer.indexer_topk_ref(queries, pool, k),
            lambda: indexer.indexer_topk_triton(queries, pool, k),
            _traffic(queries, pool, t * k),
        ),
    ]
    if not keep:  # V4: no two-level TopK
        return cases
    blocks = topk.candidate_blocks_ref(
        indexer.indexer_logits_ref(queries, pool), queries.visible, cand_block, keep
    )
    cand_keys = blocks.shape[1] * cand_block * t  # a consumer reads its candidates' keys only
    return cases + [
        case(
            "candidate source",
            lambda: indexer.indexer_topk_and_candidates_ref(queries, pool, k, cand_block, keep),
            lambda: indexer.indexer_topk_and_candidates_triton(queries, pool, k, cand_block, keep),
            _traffic(queries, pool, t * (k + keep)),
        ),
        case(
            "candidate consumer",
            lambda: indexer.indexer_topk_in_candidates_ref(queries, pool, k, blocks, cand_block),
            lambda: indexer.indexer_topk_in_candidates_triton(queries, pool, k, blocks, cand_block),
            _traffic(queries, pool, t * k, keys=cand_keys) + blocks.numel() * 4,
            2 * h * d * cand_keys,
        ),
    ]


def topk_cases(cfg: ModelConfig, phase: Phase, dev: torch.device, dtype: torch.dtype) -> list[Case]:
    queries, pool = _inputs(cfg, phase, dev, torch.float32, int8=False)
    scores = indexer.indexer_logits_ref(queries, pool)
    k, visible = cfg.index_topk, queries.visible
    cases = [
        Case(
            "topk",
            "topk_positions",
            phase,
            lambda: topk.topk_positions_ref(scores, k),
            lambda: topk.topk_positions_triton(scores, k),
            elements_bytes(scores) + 4 * phase.total * k,
        )
    ]
    cand_block, keep = cfg.candidate_block_size, cfg.candidate_topk_blocks
    if keep:
        cases.append(
            Case(
                "topk",
                "candidate_blocks",
                phase,
                lambda: topk.candidate_blocks_ref(scores, visible, cand_block, keep),
                lambda: topk.candidate_blocks_triton(scores, visible, cand_block, keep),
                elements_bytes(scores, visible) + 4 * phase.total * keep,
            )
        )
    return cases


def quant_cases(cfg: ModelConfig, phase: Phase, dev: torch.device, dtype: torch.dtype) -> list[Case]:
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(phase.total, cfg.index_n_heads, cfg.index_head_dim, generator=gen, device=dev).to(dtype)
    rows = q.numel() // q.shape[-1]
    return [
        Case(
            "quant",
            "quantize_int8 (indexer queries)",
            phase,
            lambda: quant.quantize_int8_ref(q),
            lambda: quant.quantize_int8_triton(q),
            elements_bytes(q) + q.numel() + 4 * rows,
        )
    ]
