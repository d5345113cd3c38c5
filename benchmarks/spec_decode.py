"""Speculative decoding on the tiny models: tokens per target pass and wall-clock speed-up.

``python -m benchmarks.spec_decode [--arch v4 v4-dspark v41] [--requests 4] [--prompt-len 64]
[--max-tokens 64] [--k 3]``

For each model, the same greedy batch runs side by side in one process: without drafts, with the
scripted proposer forced to propose the target's own tokens (every draft accepted: the ceiling),
and with the checkpoint's real draft head (V4 MTP, V4.1 DSpark). A target pass per request is one
step in which the request emits tokens. The tiny checkpoints are random: their draft heads are not
trained against their targets, so their acceptance says nothing about a real checkpoint's.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from benchmarks.tiny_batch import tiny_batch
from engine.llm_engine import EngineConfig, LLMEngine
from engine.request import Request, SamplingParams
from engine.spec_decode.proposer import Proposer, ScriptedProposer
from model.checkpoint import placement_arguments

METHODS = {"v4": "mtp", "v4-dspark": "dspark", "v41": "dspark"}


@dataclass
class Result:
    outputs: list[list[int]]
    seconds: float
    tokens: int
    passes: int  # (request, step) pairs in which the request emitted tokens
    mean_accepted_length: float | None  # None without drafts

    @property
    def tokens_per_pass(self) -> float:
        return self.tokens / self.passes


def generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> Result:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    requests = [engine.add_request(p, params) for p in prompts]
    passes = 0
    while engine.has_work:
        passes += len(engine.step())
    seconds = time.perf_counter() - start
    outputs = [engine.completion(r).token_ids for r in requests]
    stats = engine.spec_stats
    accepted_length = stats.mean_accepted_length if stats.verify_steps else None
    return Result(outputs, seconds, sum(map(len, outputs)), passes, accepted_length)


def forced_accept(reference: dict[tuple[int, ...], list[int]]) -> Proposer:
    def script(request: Request, k: int) -> list[int]:
        return reference[tuple(request.prompt)][len(request.output) : len(request.output) + k]

    return ScriptedProposer(script)


def bench(arch: str, args: argparse.Namespace) -> None:
    model, tokenizer, prompts = tiny_batch(arch, args)

    def run(proposer: Proposer | None = None, method: str | None = None) -> Result:
        k = args.k if proposer or method else None
        config = EngineConfig(speculative_method=method, num_speculative_tokens=k)
        return generate(LLMEngine(model, tokenizer, config, proposer), prompts, args.max_tokens)

    generate(LLMEngine(model, tokenizer, EngineConfig()), prompts[:1], 4)  # warm-up
    base = run()
    reference = {tuple(p): out for p, out in zip(prompts, base.outputs, strict=True)}
    rows = [
        ("no drafts", base),
        (f"forced accept, k={args.k}", run(forced_accept(reference))),
        (f"{METHODS[arch]}, k={args.k}", run(method=METHODS[arch])),
    ]
    shape = f"{args.requests} requests x {args.max_tokens} greedy tokens, prompts of {args.prompt_len}"
    print(f"tiny {arch}: {shape}")
    print(f"  {'proposer':<22}{'tok/pass':>9}{'accepted len':>14}{'seconds':>9}{'speed-up':>10}  same output")
    for name, r in rows:
        length = "-" if r.mean_accepted_length is None else f"{r.mean_accepted_length:.2f}"
        print(f"  {name:<22}{r.tokens_per_pass:9.2f}{length:>14}{r.seconds:9.2f}"
              f"{base.seconds / r.seconds:10.2f}  {r.outputs == base.outputs}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", nargs="+", choices=sorted(METHODS), default=sorted(METHODS))
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=3, help="drafts per step")
    placement_arguments(parser)
    args = parser.parse_args(argv)
    for arch in args.arch:
        bench(arch, args)


if __name__ == "__main__":
    main()
