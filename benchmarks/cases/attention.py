"""Sparse attention and KV compressor cases.

Attention: the model's heads and head dim over a sliding window of ``sliding_window`` keys plus
``index_topk`` compressed entries, RoPE on the last ``qk_rope_head_dim`` channels; a decode token reads
rows of its own request, the tokens of a prefill chunk share one pool. Traffic counts every gathered
row, the query, output and log-sum-exp once; FLOPs are ``4·T·H·K·D`` (scores and values).
Compressor: one case per compress ratio of the model at the head dim, with its variant (V4: gate
position bias and rotated entries, overlap at ratio 4, plus the CSA indexer's own compressor at the
indexer head dim; V4.1: plain latents, no gate at ratio 1). Decode requests sit at
the last token of a window, so every step closes one per request. Traffic: projections read once, each
entry's earlier rows and overlap slice from the state, entries written.
"""

from __future__ import annotations

import torch

from benchmarks.cases.case import Case, elements_bytes
from benchmarks.workload import Phase
from model.config import ModelConfig
from triton_kernels import compressor, sparse_attn
from triton_kernels.compressor import CompressBatch, CompressorParams, CompressorStates
from triton_kernels.quant import quantize_int8_ref
from triton_kernels.rope import rope_inv_freq
from triton_kernels.sparse_attn import KVPool


def _inv_freq(cfg: ModelConfig, dev: torch.device) -> torch.Tensor:
    return rope_inv_freq(cfg.qk_rope_head_dim, cfg.compress_rope_theta).to(dev)


def attention_cases(cfg: ModelConfig, phase: Phase, dev: torch.device, dtype: torch.dtype) -> list[Case]:
    gen = torch.Generator(device=dev).manual_seed(0)
    t, heads, dim = phase.total, cfg.num_attention_heads, cfg.head_dim
    window, k = cfg.sliding_window, cfg.sliding_window + cfg.index_topk
    q = torch.randn(t, heads, dim, generator=gen, device=dev).to(dtype)
    if phase.label == "decode":
        rows = t * k
        idx = torch.randperm(rows, generator=gen, device=dev).view(t, k).int()
    else:
        rows = max(k, t)
        idx = torch.randint(0, rows, (t, k), generator=gen, device=dev, dtype=torch.int32)
    kv = torch.randn(rows, dim, generator=gen, device=dev)
    sink = torch.randn(heads, generator=gen, device=dev)
    positions = torch.arange(phase.context - t, phase.context, device=dev)
    float_tag = "bf16" if dtype == torch.bfloat16 else "fp32"
    cases = []
    for tag, (table, scale) in ((float_tag, (kv.to(dtype), None)), ("int8", quantize_int8_ref(kv))):
        pools = [KVPool(table, idx[:, :window], scale), KVPool(table, idx[:, window:], scale)]
        args = (q, pools, sink, dim**-0.5, positions, _inv_freq(cfg, dev))
        row_bytes = dim * table.element_size() + (4 if scale is not None else 0)
        cases.append(
            Case(
                "sparse_attn",
                f"sparse_attention {tag}",
                phase,
                lambda a=args: sparse_attn.sparse_attention_ref(*a),
                lambda a=args: sparse_attn.sparse_attention_triton(*a),
                t * k * (row_bytes + 4) + 2 * elements_bytes(q) + 4 * t * heads,
                4 * t * heads * k * dim,
            )
        )
    return cases


def compressor_cases(cfg: ModelConfig, phase: Phase, dev: torch.device, dtype: torch.dtype) -> list[Case]:
    shapes = [(r, cfg.head_dim) for r in sorted(set(cfg.compress_ratios) - {0})]
    if not cfg.is_v41 and 4 in cfg.compress_ratios:  # V4's CSA indexer compresses its own keys
        shapes.append((4, cfg.index_head_dim))
    return [_compressor(cfg, phase, dev, dtype, ratio, dim) for ratio, dim in shapes]


def _compressor(
    cfg: ModelConfig, phase: Phase, dev: torch.device, dtype: torch.dtype, ratio: int, dim: int
) -> Case:
    gen = torch.Generator(device=dev).manual_seed(0)
    reqs, tokens, v4 = phase.requests, phase.tokens, not cfg.is_v41
    overlap = v4 and ratio == 4
    width = (2 if overlap else 1) * dim
    n = phase.total
    kv = torch.randn(n, width, generator=gen, device=dev).to(dtype)
    gate = torch.randn(n, width, generator=gen, device=dev).to(dtype) if ratio > 1 else None
    start = ratio - 1 if tokens == 1 else 0
    positions = start + torch.arange(tokens, device=dev).repeat(reqs)
    closes = (positions + 1) % ratio == 0
    slots = torch.full((n,), -1, dtype=torch.int32, device=dev)
    slots[closes] = torch.arange(int(closes.sum()), dtype=torch.int32, device=dev)
    batch = CompressBatch.build(
        ratio,
        torch.arange(0, n + 1, tokens, dtype=torch.int32, device=dev),
        torch.full((reqs,), start, dtype=torch.int32, device=dev),
        torch.arange(reqs, dtype=torch.int32, device=dev),
        slots,
    )
    ape = torch.zeros(ratio, width, device=dev) if v4 else None
    params = CompressorParams(
        ratio, overlap, torch.ones(dim, device=dev), 1e-6, ape, _inv_freq(cfg, dev) if v4 else None
    )
    states = CompressorStates.empty(reqs, ratio, dim, overlap, dev)
    out = torch.empty(int(closes.sum()), dim, dtype=dtype, device=dev)
    args = (kv, gate, batch, states, params, out)
    held = (start % ratio) * width * 8 + (ratio * dim * 8 if overlap else 0)
    traffic = elements_bytes(kv, *([gate] if gate is not None else [])) + reqs * held + elements_bytes(out)
    return Case(
        "compressor",
        f"compress r={ratio} c={dim} {'bf16' if dtype == torch.bfloat16 else 'fp32'}",
        phase,
        lambda: compressor.compress_ref(*args),
        lambda: compressor.compress_triton(*args),
        traffic,
    )
