"""Tensor parallel on this machine: output tokens/s and each rank's memory for TP=1 and TP=2.

``python -m benchmarks.parallel [--arch v41] [--requests 8] [--prompt-len 64] [--max-tokens 16]
[--sizes 1 2] [--threads 1]``

Every size serves the same greedy requests through ``LLM(tensor_parallel_size=N)``; each line gives the
output tokens/s, every rank's resident weight bytes and KV cache bytes (as the ranks report them), and
whether the tokens equal those of the first size. On a CPU the ranks share the cores and talk through
gloo, so the speed is for the record only: what TP=N buys there is the memory per rank.
"""

from __future__ import annotations

import argparse
import time

import torch

import benchmarks.common  # noqa: F401  (sets the interpreter switch before any kernel module loads)
from engine.llm import LLM
from engine.request import SamplingParams
from engine.workers import RankReport, report
from model.tiny import cached_tiny


def serve_once(
    arch: str, size: int, prompts: list[list[int]], max_tokens: int
) -> tuple[float, list[RankReport], list[list[int]]]:
    llm = LLM(model=cached_tiny(arch), tensor_parallel_size=size, enable_prefix_caching=False)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        runner = llm.engine.runner
        reports = runner.reports() if size > 1 else [report(runner)]
    finally:
        llm.close()
    tokens = [out.outputs[0].token_ids for out in outputs]
    return sum(map(len, tokens)) / seconds, reports, tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", default="v41", choices=("v4", "v41"))
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every rank")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 4000, (args.requests, args.prompt_len), generator=gen).tolist()
    print(f"tiny {args.arch}: {args.requests} requests x {args.prompt_len} prompt tokens, "
          f"{args.max_tokens} new each, greedy; {args.threads} thread(s) per rank")  # fmt: skip
    first = None
    for size in args.sizes:
        rate, reports, tokens = serve_once(args.arch, size, prompts, args.max_tokens)
        first = first or tokens
        ranks = ", ".join(
            f"rank {r}: weights {rank.weight_bytes / 2**20:.2f} MiB, KV {rank.cache_bytes / 2**20:.1f} MiB"
            for r, rank in enumerate(reports)
        )
        same = f"same tokens as TP={args.sizes[0]}" if tokens == first else "TOKENS DIFFER"
        print(f"TP={size}: {rate:.1f} output tokens/s; {ranks}; {same}")


if __name__ == "__main__":
    main()
