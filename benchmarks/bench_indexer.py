"""Time the indexer, top-k and int8 quantisation kernels against their torch references.

    python -m benchmarks.bench_indexer [--large] [--iters N]

Runs on the current backend. On a CPU the kernels go through the Triton interpreter (set here,
before triton is imported), so the default shapes are small and the ratio says little about
speed; ``--large`` takes the model's shapes (64 heads x 128 dims, long contexts, k = 512 / 2048).
On a GPU each line also gives the achieved bandwidth over the op's compulsory HBM traffic (every
key, query, score and output read or written once) and its fraction of the device's HBM peak;
on other devices the peak is a measured device-to-device copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Without a device this switches the kernels to the interpreter, which must precede importing triton.
from benchmarks.common import device, hbm_peak, parse_args, time_ms  # isort: split

import triton

from triton_kernels import indexer, quant, topk
from triton_kernels.indexer import IndexQueries, KeyPool


@dataclass(frozen=True)
class Shape:
    label: str
    requests: int
    tokens_per_request: int
    context: int  # entries of each request; its tokens see the last `tokens_per_request` prefixes
    heads: int
    dim: int
    k: int
    block_size: int = 64
    cand_block: int = 8
    cand_keep: int = 64


SMALL = (
    Shape("decode", requests=2, tokens_per_request=1, context=2048, heads=16, dim=64, k=64, cand_keep=32),
    Shape("prefill", requests=1, tokens_per_request=4, context=1024, heads=16, dim=64, k=64, cand_keep=32),
)
LARGE = (
    Shape(
        "decode", requests=32, tokens_per_request=1, context=32768, heads=64, dim=128, k=512, cand_keep=2048
    ),
    Shape(
        "prefill", requests=1, tokens_per_request=512, context=8192, heads=64, dim=128, k=2048, cand_keep=2048
    ),
)


def _inputs(s: Shape, device: torch.device, int8: bool) -> tuple[IndexQueries, KeyPool]:
    gen = torch.Generator(device=device).manual_seed(0)
    t = s.requests * s.tokens_per_request
    blocks = triton.cdiv(s.context, s.block_size)
    table = torch.randperm(s.requests * blocks, generator=gen, device=device).int().view(s.requests, blocks)
    keys = torch.randn(s.requests * blocks * s.block_size, s.dim, generator=gen, device=device)
    q = torch.randn(t, s.heads, s.dim, generator=gen, device=device)
    weights = torch.randn(t, s.heads, generator=gen, device=device) * (s.heads * s.dim) ** -0.5
    request = torch.arange(s.requests, device=device).repeat_interleave(s.tokens_per_request).int()
    offset = torch.arange(s.tokens_per_request, device=device).repeat(s.requests)
    visible = (s.context - s.tokens_per_request + 1 + offset).int()
    if not int8:
        return IndexQueries(q, weights, request, visible), KeyPool(keys, table, s.block_size)
    (q8, qs), (k8, ks) = quant.quantize_int8(q), quant.quantize_int8(keys)
    return IndexQueries(q8, weights, request, visible, qs), KeyPool(k8, table, s.block_size, ks)


def _traffic(queries: IndexQueries, pool: KeyPool, out_elems: int, entries: int | None = None) -> int:
    """Compulsory bytes: each request's visible keys (+ scales) once, queries, weights, outputs."""
    per_key = pool.keys.shape[1] * pool.keys.element_size() + (4 if pool.scale is not None else 0)
    seen = torch.zeros(pool.block_table.shape[0], dtype=torch.long, device=queries.visible.device)
    seen = seen.scatter_reduce(0, queries.request.long(), queries.visible.long(), "amax")
    keys = int(seen.sum()) if entries is None else entries
    q = queries.q.numel() * queries.q.element_size() + queries.weights.numel() * 4
    return keys * per_key + q + 4 * out_elems


def _cases(
    s: Shape, device: torch.device
) -> list[tuple[str, Callable[[], object], Callable[[], object], int]]:
    """(name, reference, kernel, compulsory bytes) for every op at this shape."""
    f32, i8 = _inputs(s, device, int8=False), _inputs(s, device, int8=True)
    t = f32[0].q.shape[0]
    width = f32[1].capacity
    logits = indexer.indexer_logits_ref(*f32)
    blocks = topk.candidate_blocks_ref(logits, f32[0].visible, s.cand_block, s.cand_keep)
    cand_keys = blocks.shape[1] * s.cand_block * t  # consumers read only candidate keys, per query
    cases = []
    for tag, (queries, pool) in (("fp32", f32), ("int8", i8)):
        cases += [
            (
                f"indexer_logits {tag}",
                lambda q=queries, p=pool: indexer.indexer_logits_ref(q, p),
                lambda q=queries, p=pool: indexer.indexer_logits_triton(q, p),
                _traffic(queries, pool, t * width),
            ),
            (
                f"indexer_topk {tag} (fused)",
                lambda q=queries, p=pool: indexer.indexer_topk_ref(q, p, s.k),
                lambda q=queries, p=pool: indexer.indexer_topk_triton(q, p, s.k),
                _traffic(queries, pool, t * s.k),
            ),
            (
                f"candidate source {tag}",
                lambda q=queries, p=pool: indexer.indexer_topk_and_candidates_ref(
                    q, p, s.k, s.cand_block, s.cand_keep
                ),
                lambda q=queries, p=pool: indexer.indexer_topk_and_candidates_triton(
                    q, p, s.k, s.cand_block, s.cand_keep
                ),
                _traffic(queries, pool, t * (s.k + s.cand_keep)),
            ),
            (
                f"candidate consumer {tag}",
                lambda q=queries, p=pool: indexer.indexer_topk_in_candidates_ref(
                    q, p, s.k, blocks, s.cand_block
                ),
                lambda q=queries, p=pool: indexer.indexer_topk_in_candidates_triton(
                    q, p, s.k, blocks, s.cand_block
                ),
                _traffic(queries, pool, t * s.k, entries=cand_keys) + blocks.numel() * 4,
            ),
        ]
    cases += [
        (
            "topk_positions",
            lambda: topk.topk_positions_ref(logits, s.k),
            lambda: topk.topk_positions_triton(logits, s.k),
            logits.numel() * 4 + t * s.k * 4,
        ),
        (
            "candidate_blocks",
            lambda: topk.candidate_blocks_ref(logits, f32[0].visible, s.cand_block, s.cand_keep),
            lambda: topk.candidate_blocks_triton(logits, f32[0].visible, s.cand_block, s.cand_keep),
            logits.numel() * 4 + t * s.cand_keep * 4,
        ),
        (
            "quantize_int8 (keys)",
            lambda: quant.quantize_int8_ref(f32[1].keys),
            lambda: quant.quantize_int8_triton(f32[1].keys),
            f32[1].keys.numel() * 5 + f32[1].keys.shape[0] * 4,
        ),
    ]
    return cases


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv)
    dev = device()
    peak = hbm_peak(dev)
    if peak:
        print(f"bandwidth peak {peak[0] / 1e9:.0f} GB/s ({peak[1]})")
    for s in LARGE if args.large else SMALL:
        print(
            f"\n{s.label}: {s.requests} requests x {s.tokens_per_request} tokens, context {s.context},"
            f" H={s.heads} D={s.dim} k={s.k}, candidates {s.cand_keep} x {s.cand_block}"
        )
        print(
            f"  {'op':<28}{'torch ms':>11}{'kernel ms':>11}{'ratio':>9}"
            + ("    GB/s  of peak" if peak else "")
        )
        for name, ref, kernel, traffic in _cases(s, dev):
            ref_ms, kernel_ms = time_ms(ref, args.iters), time_ms(kernel, args.iters)
            line = f"  {name:<28}{ref_ms:>11.3f}{kernel_ms:>11.3f}{ref_ms / kernel_ms:>8.2f}x"
            if peak:
                rate = traffic / (kernel_ms * 1e-3)
                line += f"{rate / 1e9:>8.0f}  {rate / peak[0]:>6.1%}"
            print(line)


if __name__ == "__main__":
    main()
