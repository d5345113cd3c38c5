"""Time the sparse attention and KV compressor kernels against their torch references.

    python -m benchmarks.bench_attention [--large] [--iters N]

Runs on the current backend. On a CPU the kernels go through the Triton interpreter, so the default
shapes are small and the ratio says little about speed; ``--large`` takes the model's shapes (64 heads
x 512, a 128-key window plus 512 compressed entries; c = 512 compressors). On a device the decode
attention and the compressor report the achieved bandwidth over their compulsory HBM traffic (every
gathered KV row, query, output, projection and state row once) against the HBM peak (nominal for
known GPUs, else a measured copy), and prefill attention its TFLOP/s (``4·T·H·K·D``) against the
dense bf16 peak of known GPUs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Without a device this switches the kernels to the interpreter, which must precede importing triton.
from benchmarks.common import device, flops_peak, hbm_peak, parse_args, time_ms  # isort: split

from triton_kernels import compressor, runtime, sparse_attn
from triton_kernels.compressor import CompressBatch, CompressorParams, CompressorStates
from triton_kernels.quant import quantize_int8_ref
from triton_kernels.rope import rope_inv_freq
from triton_kernels.sparse_attn import KVPool


@dataclass(frozen=True)
class Attn:
    label: str
    tokens: int
    heads: int
    window: int
    compressed: int
    dim: int = 512


@dataclass(frozen=True)
class Comp:
    label: str
    requests: int
    tokens: int  # per request
    ratio: int
    dim: int = 512


SMALL = (
    Attn("decode", tokens=1, heads=16, window=128, compressed=512),
    Attn("prefill", tokens=4, heads=16, window=128, compressed=512),
    Comp("decode", requests=8, tokens=1, ratio=4),
    Comp("prefill", requests=1, tokens=64, ratio=4),
)
LARGE = (
    Attn("decode", tokens=16, heads=64, window=128, compressed=512),
    Attn("prefill", tokens=4096, heads=64, window=128, compressed=512),
    Comp("decode", requests=256, tokens=1, ratio=4),
    Comp("prefill", requests=1, tokens=8192, ratio=4),
    Comp("prefill", requests=1, tokens=8192, ratio=128),
)
Case = tuple[str, Callable[[], object], Callable[[], object], int, int]  # name, ref, kernel, bytes, flops


def _attention(s: Attn, dev: torch.device, dtype: torch.dtype) -> list[Case]:
    gen = torch.Generator(device=dev).manual_seed(0)
    t, k = s.tokens, s.window + s.compressed
    q = torch.randn(t, s.heads, s.dim, generator=gen, device=dev).to(dtype)
    if s.label == "decode":  # every token reads rows of its own (its request's window and entries)
        rows = t * k
        idx = torch.randperm(rows, generator=gen, device=dev).view(t, k).int()
    else:  # the tokens of a prompt share a pool as long as the prompt
        rows = max(k, t)
        idx = torch.randint(0, rows, (t, k), generator=gen, device=dev, dtype=torch.int32)
    kv = torch.randn(rows, s.dim, generator=gen, device=dev)
    sink = torch.randn(s.heads, generator=gen, device=dev)
    positions, inv_freq = torch.arange(t, device=dev), rope_inv_freq(64, 160000.0).to(dev)
    cases = []
    float_tag = "bf16" if dtype == torch.bfloat16 else "fp32"
    for tag, (table, scale) in ((float_tag, (kv.to(dtype), None)), ("int8", quantize_int8_ref(kv))):
        pools = [KVPool(table, idx[:, : s.window], scale), KVPool(table, idx[:, s.window :], scale)]
        args = (q, pools, sink, s.dim**-0.5, positions, inv_freq)
        row_bytes = s.dim * table.element_size() + (4 if scale is not None else 0)
        traffic = t * k * (row_bytes + 4) + 2 * q.numel() * q.element_size() + t * s.heads * 4
        cases.append(
            (
                f"sparse_attention {tag}",
                lambda a=args: sparse_attn.sparse_attention_ref(*a),
                lambda a=args: sparse_attn.sparse_attention_triton(*a),
                traffic,
                4 * t * s.heads * k * s.dim,
            )
        )
    return cases


def _compressor(s: Comp, dev: torch.device, dtype: torch.dtype) -> list[Case]:
    gen = torch.Generator(device=dev).manual_seed(0)
    overlap = s.ratio == 4
    width = (2 if overlap else 1) * s.dim
    n = s.requests * s.tokens
    kv = torch.randn(n, width, generator=gen, device=dev).to(dtype)
    gate = torch.randn(n, width, generator=gen, device=dev).to(dtype)
    # Decode requests sit at the last token of a window, so every step closes one per request.
    start = s.ratio - 1 if s.tokens == 1 else 0
    positions = start + torch.arange(s.tokens, device=dev).repeat(s.requests)
    closes = (positions + 1) % s.ratio == 0
    slots = torch.full((n,), -1, dtype=torch.int32, device=dev)
    slots[closes] = torch.arange(int(closes.sum()), dtype=torch.int32, device=dev)
    batch = CompressBatch(
        torch.arange(0, n + 1, s.tokens, dtype=torch.int32, device=dev),
        torch.full((s.requests,), start, dtype=torch.int32, device=dev),
        torch.arange(s.requests, dtype=torch.int32, device=dev),
        slots,
    )
    ape, inv_freq = torch.zeros(s.ratio, width, device=dev), rope_inv_freq(64, 160000.0).to(dev)
    params = CompressorParams(s.ratio, overlap, torch.ones(s.dim, device=dev), 1e-6, ape, inv_freq)
    states = CompressorStates.empty(s.requests, s.ratio, s.dim, overlap, dev)
    out = torch.empty(int(closes.sum()), s.dim, dtype=dtype, device=dev)
    args = (kv, gate, batch, states, params, out)
    # Projections read once, each entry's earlier rows and overlap slice from the state, entries written.
    held = (start % s.ratio) * width * 8 + (s.ratio * s.dim * 8 if overlap else 0)
    traffic = 2 * kv.numel() * kv.element_size() + s.requests * held + out.numel() * out.element_size()
    label = f"compress r={s.ratio} {'bf16' if dtype == torch.bfloat16 else 'fp32'}"
    return [
        (label, lambda: compressor.compress_ref(*args), lambda: compressor.compress_triton(*args), traffic, 0)
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv)
    dev = device()
    dtype = torch.float32 if runtime.backend() == "cpu" else torch.bfloat16
    bandwidth, compute = hbm_peak(dev), flops_peak()
    for peak, unit, scale in ((bandwidth, "GB/s", 1e9), (compute, "TFLOP/s", 1e12)):
        if peak:
            print(f"peak {peak[0] / scale:.0f} {unit} ({peak[1]})")
    for s in LARGE if args.large else SMALL:
        if isinstance(s, Attn):
            path = "split + merge" if sparse_attn.decode_split(s.tokens, s.heads) else "one pass"
            shape = f"T={s.tokens} H={s.heads} D={s.dim} K={s.window}+{s.compressed}"
            print(f"\nattention {s.label} ({path}): {shape}")
            cases = _attention(s, dev, dtype)
        else:
            print(f"\ncompressor {s.label}: {s.requests} requests x {s.tokens} tokens, c={s.dim}")
            cases = _compressor(s, dev, dtype)
        rate = "   rate       of peak" if runtime.backend() != "cpu" else ""
        print(f"  {'op':<24}{'torch ms':>11}{'kernel ms':>11}{'ratio':>9}{rate}")
        for name, ref, kernel, traffic, flops in cases:
            ref_ms, kernel_ms = time_ms(ref, args.iters), time_ms(kernel, args.iters)
            line = f"  {name:<24}{ref_ms:>11.3f}{kernel_ms:>11.3f}{ref_ms / kernel_ms:>8.2f}x"
            seconds = kernel_ms * 1e-3
            if runtime.backend() != "cpu" and isinstance(s, Attn) and s.label == "prefill":
                line += f"{flops / seconds / 1e12:>8.1f} TFLOP/s"
                line += f"  {flops / seconds / compute[0]:>6.1%}" if compute else ""
            elif bandwidth:
                line += f"{traffic / seconds / 1e9:>8.0f} GB/s   {traffic / seconds / bandwidth[0]:>6.1%}"
            print(line)


if __name__ == "__main__":
    main()
