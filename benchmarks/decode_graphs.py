"""Decode graphs: the engine's decode step with and without them, and whether the greedy outputs agree.

``python -m benchmarks.decode_graphs [--arch v4 v41] [--requests 8] [--prompt-len 64] [--max-tokens 32]
[--device D] [--dtype T]``

For each model the same greedy batch runs in one process, first with ``enforce_eager``, then with the
decode graphs the engine captures when it starts (every capture size up to ``--requests``; on a CPU the
``cpu`` graphs, ``cpu_graphs``). Each side runs the batch once untimed first (a device compiles its Triton
kernels at their first launch). Printed: the mean decode step (the steps after the prompts' one pass;
every step reads its sampled tokens back to the host, so the device's queued work counts), the capture
time, the speed-up and whether the outputs are the same.
"""

from __future__ import annotations

import argparse
import time

from tokenizers import Tokenizer

from benchmarks.tiny_batch import tiny_batch
from engine.llm_engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from model.causal_lm import CausalLM
from model.checkpoint import placement_arguments


def start(model: CausalLM, tokenizer: Tokenizer, config: EngineConfig) -> tuple[LLMEngine, float]:
    """The engine and the seconds it took to start (its graphs captured, unless ``enforce_eager``)."""
    begin = time.perf_counter()
    engine = LLMEngine(model, tokenizer, config)
    return engine, time.perf_counter() - begin


def decode(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds per decode step (every step after the prompts' pass) and the greedy outputs."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    engine.step()  # every prompt in one pass: the token budget holds them all
    steps, begin = 0, time.perf_counter()
    while engine.has_work:
        engine.step()
        steps += 1
    return (time.perf_counter() - begin) / steps, [list(r.output) for r in requests]


def bench(arch: str, args: argparse.Namespace) -> None:
    model, tokenizer, prompts = tiny_batch(arch, args)
    device, dtype = model.embed.weight.device, model.embed.weight.dtype
    results = {}
    for eager in (True, False):
        config = EngineConfig(
            max_num_seqs=args.requests,
            max_model_len=args.prompt_len + args.max_tokens,
            max_num_batched_tokens=max(2048, args.requests * args.prompt_len),
            enforce_eager=eager,
            cpu_graphs=True,
        )
        engine, started = start(model, tokenizer, config)
        decode(engine, prompts, args.max_tokens)  # untimed: kernels compiled, caches warm
        results[eager] = (*decode(engine, prompts, args.max_tokens), started)
    (eager_s, eager_out, _), (graph_s, graph_out, captured) = results[True], results[False]
    backend = engine.runner.graphs.backend
    shape = f"{args.requests} requests x {args.max_tokens} greedy tokens, prompts of {args.prompt_len}"
    print(f"tiny {arch}: {shape}, {device.type} {str(dtype).removeprefix('torch.')}")
    print(f"  decode step  eager {eager_s * 1e3:8.2f} ms  graphs ({backend}) {graph_s * 1e3:8.2f} ms"
          f"  speed-up {eager_s / graph_s:5.2f}  captured in {captured:.1f} s"
          f"  same output {graph_out == eager_out}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", nargs="+", choices=["v4", "v41"], default=["v4", "v41"])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    placement_arguments(parser)
    args = parser.parse_args(argv)
    # The prompts' pass makes each request's first token: a decode step needs a second one.
    for name, least in (("requests", 1), ("prompt_len", 1), ("max_tokens", 2)):
        if getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')}: {getattr(args, name)} must be at least {least}")
    for arch in args.arch:
        bench(arch, args)


if __name__ == "__main__":
    main()
