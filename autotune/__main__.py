"""Sweep every Triton kernel's configs on this device and write the tuned configs the kernels read.

    python -m autotune [--ops all|indexer,topk,...] [--model-config DIR] [--out DIR] [--max-num-seqs N]
        [--max-num-batched-tokens N] [--max-model-len N]

Shapes come from the model config (default: the tiny V4.1) and the serving limits
(``benchmarks.workload``): decode at every power-of-two batch up to ``max_num_seqs``, one prefill chunk
of ``max_num_batched_tokens``. For each op, every config of each kernel is timed per shape bucket and
the fastest valid one is written to ``<out>/<sku>/<op>.json`` (``autotune.writer``); ``--out`` defaults
to where the kernels read (``triton_kernels.tuning.tuned_dir()``). On a CPU it is a dry run: the
interpreter on tiny shapes, the files marked ``dry_run`` so that no device ever uses them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# Without a device this switches the kernels to the interpreter, which must precede importing triton.
from benchmarks.common import activation_dtype, backend_line, device  # isort: split

from autotune.sweep import BucketSweep, sweep
from autotune.writer import document, write
from benchmarks import workload
from benchmarks.cases import OPS, select
from triton_kernels import runtime, tuning


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ops", default="all", help=f"all, or some of {', '.join(OPS)}")
    workload.add_arguments(parser)
    parser.add_argument("--out", type=Path, default=tuning.tuned_dir(), help="default: %(default)s")
    return parser.parse_args(argv)


def _summary(s: BucketSweep) -> str:
    best, tried = s.best, len(s.trials)
    if best is None:
        return f"  {s.kernel.name} [{s.bucket}]: no valid config of {tried}; the default applies"
    invalid = sum(t.ms is None for t in s.trials)
    chosen = f"{best.config.params} {best.ms:.3f} ms"
    return f"  {s.kernel.name} [{s.bucket}]: {chosen} (of {tried} configs, {invalid} invalid)"


def main(argv: list[str] | None = None) -> list[Path]:
    args = parse_args(argv)
    start, dev = time.perf_counter(), device()
    dry_run = runtime.backend() == "cpu"
    try:
        ops, work = select(args.ops), workload.from_arguments(args, tiny=dry_run, every_batch=True)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    print(backend_line() + (": dry run on tiny shapes, never used on a device" if dry_run else ""))
    print(f"model {work.source}; phases: {', '.join(str(p) for p in work.phases)}")
    written = []
    for op in ops:
        cases = [c for phase in work.phases for c in OPS[op](work.model, phase, dev, activation_dtype())]
        sweeps = sweep(op, cases)
        if not sweeps:
            print(f"{op}: this model launches none of its kernels; nothing written")
            continue
        written.append(write(args.out, document(op, sweeps, work)))
        print(f"{op}: {written[-1]}")
        print("\n".join(_summary(s) for s in sweeps))
    print(f"{len(written)} files in {time.perf_counter() - start:.1f} s")
    return written


if __name__ == "__main__":
    main(sys.argv[1:])
