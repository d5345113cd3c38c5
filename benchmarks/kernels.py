"""Every operator's Triton kernel against its torch reference, placed on the device's roofline.

    python -m benchmarks.kernels [--ops all|indexer,topk,...] [--model-config DIR] [--max-num-seqs N]
        [--max-num-batched-tokens N] [--max-model-len N] [--quick] [--iters N] [--json PATH] [--plot PATH]

Shapes come from the model config (default: the tiny V4.1) and the serving limits: a decode batch of
``max_num_seqs`` and a prefill chunk of ``max_num_batched_tokens`` (``benchmarks.workload``). Each line
gives both times, the achieved GB/s over the case's compulsory traffic and TFLOP/s, and the fraction of
the binding roof (``benchmarks.roofline``): HBM bandwidth measured once by a device copy, compute peaks
from the SKU profile. The goal is >= 60% for memory-bound (decode-side) cases and >= 40% for
compute-bound (prefill-side) ones. On a CPU the kernels run in the interpreter on tiny shapes: the
times say nothing about speed and no fraction is given. ``--quick`` takes the tiny shapes and one run
on any backend.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

# Without a device this switches the kernels to the interpreter, which must precede importing triton.
from benchmarks.common import activation_dtype, backend_line, copy_bandwidth, device, time_ms  # isort: split

from benchmarks import workload
from benchmarks.cases import OPS, select
from benchmarks.roofline import Peaks, Row, plot, row, table
from triton_kernels import runtime


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ops", default="all", help=f"all, or some of {', '.join(OPS)}")
    workload.add_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, one timed run")
    parser.add_argument("--iters", type=int, default=3, help="timed runs per call on a CPU")
    parser.add_argument("--json", metavar="PATH", help="also write the rows and peaks as JSON")
    parser.add_argument("--plot", metavar="PATH", help="also plot each case's fraction of peak (PNG)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    dev, tiny = device(), args.quick or runtime.backend() == "cpu"
    try:
        ops, work = select(args.ops), workload.from_arguments(args, tiny=tiny, every_batch=False)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    profile = runtime.profile()
    peaks = Peaks(copy_bandwidth(dev), profile.bf16_flops, profile.int8_ops)
    iters = 1 if args.quick else args.iters
    print(backend_line())
    print(f"model {work.source}; phases: {', '.join(str(p) for p in work.phases)}")
    if peaks.hbm:
        nominal = f", nominal {profile.hbm_bytes_per_s / 1e9:.0f}" if profile.hbm_bytes_per_s else ""
        print(f"HBM copy bandwidth {peaks.hbm / 1e9:.0f} GB/s{nominal}")
    if peaks.bf16:
        print(f"peak compute {peaks.bf16 / 1e12:.0f} TFLOP/s bf16 (SKU profile {profile.name})")
    rows = []
    for op in ops:
        for phase in work.phases:
            for case in OPS[op](work.model, phase, dev, activation_dtype()):
                rows.append(row(case, time_ms(case.ref, iters), time_ms(case.kernel, iters), peaks))
    print(table(rows))
    if args.json:
        doc = {
            "device": runtime.device_name(),
            "sku": runtime.sku(),
            "backend": runtime.backend(),
            "interpreter": runtime.interpreter_active(),
            "model": work.source,
            "peaks": asdict(peaks),
            "rows": [asdict(r) for r in rows],
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"json written to {args.json}")
    if args.plot:
        print(plot(rows, args.plot))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
