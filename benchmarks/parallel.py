"""Tensor and data parallel on this machine: output tokens/s and each rank's memory for TP=1, TP=2 and
DP=2 with expert parallel.

``python -m benchmarks.parallel [--arch v41] [--requests 8] [--prompt-len 64] [--max-tokens 16]
[--sizes 1 2] [--dp-sizes 2] [--threads 1]``

Every layout serves the same greedy requests through ``LLM(tensor_parallel_size=N)`` or
``LLM(data_parallel_size=D, enable_expert_parallel=True)``; each line gives the
output tokens/s, every rank's resident weight bytes and KV cache bytes (as the ranks report them), and
whether the tokens equal those of the first layout. On a CPU the ranks share the cores and talk through
gloo, so the speed is for the record only: what TP=N buys there is the memory per rank; DP=D holds the
whole model but 1/D of the routed experts on each rank, and each rank its own requests' KV.
"""

from __future__ import annotations

import argparse
import time

import torch

import benchmarks.common  # noqa: F401  (sets the interpreter switch before any kernel module loads)
from engine.llm import LLM
from engine.parallel.plans import RankReport, report
from engine.request import SamplingParams
from model.testing.tiny import cached_tiny


def serve_once(
    arch: str, tp: int, dp: int, prompts: list[list[int]], max_tokens: int
) -> tuple[float, list[RankReport], list[list[int]]]:
    parallel = {"tensor_parallel_size": tp, "data_parallel_size": dp, "enable_expert_parallel": dp > 1}
    llm = LLM(cached_tiny(arch), enable_prefix_caching=False, **parallel)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        if dp > 1:
            reports = llm.engine.reports()
        else:
            runner = llm.engine.runner
            reports = runner.reports() if tp > 1 else [report(runner)]
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
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes")
    parser.add_argument("--dp-sizes", type=int, nargs="*", default=[2], help="data-parallel sizes (with EP)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every rank")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 4000, (args.requests, args.prompt_len), generator=gen).tolist()
    print(f"tiny {args.arch}: {args.requests} requests x {args.prompt_len} prompt tokens, "
          f"{args.max_tokens} new each, greedy; {args.threads} thread(s) per rank")  # fmt: skip
    first = None
    layouts = [(f"TP={n}", n, 1) for n in args.sizes] + [(f"DP={d}+EP", 1, d) for d in args.dp_sizes]
    for name, tp, dp in layouts:
        rate, reports, tokens = serve_once(args.arch, tp, dp, prompts, args.max_tokens)
        first = first or tokens
        ranks = ", ".join(
            f"rank {r}: weights {rank.weight_bytes / 2**20:.2f} MiB, KV {rank.cache_bytes / 2**20:.1f} MiB"
            for r, rank in enumerate(reports)
        )
        same = f"same tokens as {layouts[0][0]}" if tokens == first else "TOKENS DIFFER"
        print(f"{name}: {rate:.1f} output tokens/s; {ranks}; {same}")


if __name__ == "__main__":
    main()
