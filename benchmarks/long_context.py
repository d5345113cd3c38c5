"""Tiny V4.1, one request: the prefill time of a long prompt and the decode step time against context.

``python -m benchmarks.long_context [--prefill 4096] [--contexts 1024 4096 16384] [--baseline REV
[--baseline-contexts 1024]] [--device D] [--dtype T] [--kv-cache-dtype auto|int8|fp8]``

The prompt goes through the model in chunks of ``--chunk`` tokens (as the engine's token budget would
split it); the decode step is the mean over ``--steps`` one-token calls after a prompt of each context
length. With sparse attention and the two-level indexer the step should stay nearly flat: the goal is
the longest context's step within 1.5x the shortest's. ``--baseline REV`` runs the same measurement,
on the same checkpoint and in the same run, with the code of git revision ``REV`` (``git archive``
into a temporary folder; its decode steps only at ``--baseline-contexts``, as an old tree may take
long to reach a long context), so the speed-up is read off one table. The model runs on ``--device`` in
``--dtype`` (the baseline too), its cache rows stored as ``--kv-cache-dtype`` (the baseline's in the compute
dtype); each timing ends with a read of the last logits, so queued device work
counts. The numbers are for this machine only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def measure(path: Path, args: argparse.Namespace, contexts: list[int]) -> dict[str, float]:
    """Seconds to prefill ``args.prefill`` tokens, and ms per decode step at each context (keys ``ctx<N>``):
    one request grows through the contexts, each reached by prefilling from the last."""
    from model.checkpoint import load_model  # here: a --baseline child imports an old tree's modules

    if args.measure and args.device is None and args.dtype == "auto":
        device, model = torch.device("cpu"), load_model(path)  # any tree's signature and defaults
    else:
        from model.checkpoint import placement

        device, dtype = placement(args.device, args.dtype)
        model = load_model(path, dtype, device)
    prefill, chunk, steps = args.prefill, args.chunk, args.steps
    longest = max([prefill, *contexts])
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.cfg.vocab_size, (longest + steps,), generator=gen).to(device)
    result = {}

    def new_state():  # an old tree's new_state takes no cache dtype
        return model.new_state() if args.kv_cache_dtype == "auto" else model.new_state(args.kv_cache_dtype)

    with torch.no_grad():
        begin = time.perf_counter()
        _prefill(model, ids[:prefill], new_state(), chunk).cpu()
        result["prefill_s"] = time.perf_counter() - begin
        state = new_state()
        for context in sorted(contexts):
            _prefill(model, ids[state.num_tokens : context], state, chunk)
            begin = time.perf_counter()
            for t in range(context, context + steps):
                logits = model(ids[t : t + 1], state, last_only=True)
            logits.cpu()
            result[f"ctx{context}"] = (time.perf_counter() - begin) / steps * 1e3
    return result


def _prefill(model, ids: torch.Tensor, state, chunk: int) -> torch.Tensor:
    """The logits of the last chunk's last token."""
    for start in range(0, ids.shape[0], chunk):
        logits = model(ids[start : start + chunk], state, last_only=True)
    return logits


def baseline(rev: str, path: Path, args: argparse.Namespace) -> dict[str, float]:
    """``measure`` with the code of git revision ``rev``, in a child process."""
    with tempfile.TemporaryDirectory() as tree:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
        env = {**os.environ, "PYTHONPATH": tree}
        command = [sys.executable, __file__, "--measure", str(path), *_measure_flags(args)]
        out = subprocess.run(command, env=env, check=True, capture_output=True, text=True, cwd=tree)
    return json.loads(out.stdout.splitlines()[-1])


def _measure_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--prefill", str(args.prefill), "--chunk", str(args.chunk), "--steps", str(args.steps)]
    flags += ["--dtype", args.dtype] if args.dtype != "auto" else []  # an old tree may not take them
    flags += ["--device", args.device] if args.device else []
    return [*flags, "--contexts", *map(str, args.baseline_contexts)]


def report(name: str, result: dict[str, float], contexts: list[int], prefill: int) -> None:
    steps = "  ".join(f"{c}: {result[f'ctx{c}']:.1f} ms" for c in contexts)
    print(f"{name:>10}  prefill of {prefill} tokens {result['prefill_s']:6.2f} s   decode step at {steps}")
    if len(contexts) > 1:
        growth = result[f"ctx{max(contexts)}"] / result[f"ctx{min(contexts)}"]
        print(f"{'':>10}  step at {max(contexts)} / step at {min(contexts)} = {growth:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", type=int, default=4096)
    parser.add_argument("--contexts", type=int, nargs="*", default=[1024, 4096, 16384])
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--baseline", metavar="REV", help="also measure the code of this git revision")
    parser.add_argument(
        "--baseline-contexts", type=int, nargs="*", default=[1024], help="decode contexts of the baseline"
    )
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # the child of --baseline
    # Declared here rather than by model.checkpoint.placement_arguments: the --baseline child runs this
    # script against an old tree's modules, which may not have it.
    parser.add_argument("--device", help="npu, cuda or cpu (default: the accelerator present, else cpu)")
    parser.add_argument(
        "--dtype", default="auto", help="auto (bf16 on npu / cuda, fp32 on cpu), bfloat16, float32"
    )
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8", "fp8"))
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args, args.contexts)))
        return
    from model.checkpoint import placement
    from model.testing.tiny import write_tiny

    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny(Path(tmp) / "v41", "v41")
        ours = measure(path, args, args.contexts)
        device, dtype = placement(args.device, args.dtype)
        where = f"{device.type} {str(dtype).removeprefix('torch.')}, {args.kv_cache_dtype} KV cache"
        threads = torch.get_num_threads()
        print(f"tiny V4.1, one request, chunks of {args.chunk} tokens, {threads} threads, {where}:")
        report("this tree", ours, args.contexts, args.prefill)
        sys.stdout.flush()
        if args.baseline:
            theirs = baseline(args.baseline, path, args)
            report(args.baseline, theirs, args.baseline_contexts, args.prefill)
            print(f"prefill speed-up over {args.baseline}: {theirs['prefill_s'] / ours['prefill_s']:.1f}x")


if __name__ == "__main__":
    main()
