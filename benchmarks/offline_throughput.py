"""Offline throughput of the engine next to transformers on the tiny V4 checkpoint.

``python -m benchmarks.offline_throughput [--equal 8 128 64] [--requests 64] [--max-tokens 16] [--repeat 3]
[--device D] [--dtype T] [--kv-cache-dtype auto|int8|fp8]``

(a) Output tokens/s of ``LLMEngine`` for equal prompts (8 x 128 tokens, 64 new each by default) next to
    transformers' batched ``DeepseekV4ForCausalLM.generate`` over the same prompts (one ``[8, 128]``
    batch: equal lengths need no padding), both greedy; the ratio, and whether the outputs are identical.
(b) The same for requests of mixed lengths against transformers' best mode for them: one batch per prompt
    length (its V4 cache has no padding support, so prompts of different lengths cannot share a batch).
Our engine runs on ``--device`` in ``--dtype``, its KV cache rows stored as ``--kv-cache-dtype``, sized for
the workload and with its decode graphs (``start_engine``: on the CPU ``cpu_graphs``, captured before the
timed runs, the start-up time printed);
transformers stays the fp32 CPU reference (outputs in bf16 or over a quantised cache need not match it
token for token). Both are measured side by side in one run, ``--repeat`` times each, taking turns, and
each side's fastest run counts (a shared machine's slow phases otherwise decide the ratio: one engine run
took 1.9 s and another 5.9 s in the same hour); the numbers are for this machine only (the V4.1 decode
step against context is ``benchmarks.long_context``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from engine.llm_engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from model.checkpoint import load_model, placement, placement_arguments, read_tensors
from model.hf_names import to_transformers
from model.testing.tiny import write_tiny
from model.tokenizer import load_tokenizer


def mixed_prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 512, (count,), generator=gen).tolist()
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def equal_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=gen).tolist()


Placement = tuple[torch.device, torch.dtype]


def start_engine(
    path: Path, prompts: list[list[int]], max_tokens: int, place: Placement, kv_cache_dtype: str = "auto"
) -> LLMEngine:
    """The engine sized for the workload, as a user serves it: ``max_num_seqs`` the requests,
    ``max_model_len`` the longest prompt and its new tokens, decode graphs on every device (on the CPU,
    ``cpu_graphs``: a graph's step computes over ``max_model_len``), captured here, before any timed run."""
    model = load_model(path, place[1], place[0])
    config = EngineConfig(
        max_num_seqs=len(prompts),
        max_model_len=max(map(len, prompts)) + max_tokens,
        max_num_batched_tokens=2048,
        kv_cache_dtype=kv_cache_dtype,
        cpu_graphs=True,
    )
    return LLMEngine(model, load_tokenizer(path), config)


def engine_throughput(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int
) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    requests = [engine.add_request(p, params) for p in prompts]
    while engine.has_work:
        engine.step()
    seconds = time.perf_counter() - start
    return seconds, [list(r.output) for r in requests]


def transformers_model(path: Path):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    config = DeepseekV4Config(**json.loads((path / "config.json").read_text()))
    config._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(config).float().eval()
    model.load_state_dict(to_transformers(read_tensors(path)), strict=True)
    # No end-of-sequence token: like the engine's ``ignore_eos``, every request makes all its tokens.
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    return model


def transformers_throughput(
    path: Path, prompts: list[list[int]], max_tokens: int
) -> tuple[float, list[list[int]]]:
    """Greedy ``generate`` with one batch per prompt length; outputs in the order of ``prompts``."""
    model = transformers_model(path)
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(len(p), []).append(i)
    outputs: list[list[int]] = [[] for _ in prompts]
    start = time.perf_counter()
    with torch.no_grad():
        for length, members in groups.items():
            batch = torch.tensor([prompts[i] for i in members])
            out = model.generate(batch, max_new_tokens=max_tokens, do_sample=False)
            for i, row in zip(members, out[:, length:].tolist(), strict=True):
                outputs[i] = row
    return time.perf_counter() - start, outputs


def compare(
    label: str,
    path: Path,
    prompts: list[list[int]],
    max_tokens: int,
    place: Placement,
    kv_cache_dtype: str,
    repeat: int,
) -> None:
    begin = time.perf_counter()
    engine = start_engine(path, prompts, max_tokens, place, kv_cache_dtype)
    started = time.perf_counter() - begin
    runs = [
        (engine_throughput(engine, prompts, max_tokens), transformers_throughput(path, prompts, max_tokens))
        for _ in range(repeat)
    ]
    (ours, our_out), (theirs, their_out) = (
        min(side, key=lambda run: run[0]) for side in zip(*runs, strict=True)
    )
    ours_rate = sum(map(len, our_out)) / ours
    their_rate = sum(map(len, their_out)) / theirs
    batches = len({len(p) for p in prompts})
    mode = f"{batches} batch{'es' if batches > 1 else ''}, one per prompt length"
    print(f"tiny V4, {label}, {max_tokens} new tokens each, greedy:")
    where = f"{place[0].type} {str(place[1]).removeprefix('torch.')}, {kv_cache_dtype} KV cache"
    graphs = engine.runner.graphs
    where += f", decode graphs: {graphs.backend} (started in {started:.1f} s)" if graphs else ", eager"
    best = f"best of {repeat}"
    print(f"  engine        {ours_rate:8.1f} output tok/s ({ours:.1f} s {best}, {where})")
    print(f"  transformers  {their_rate:8.1f} output tok/s ({theirs:.1f} s {best}, {mode}, cpu float32)")
    print(f"  ratio engine / transformers = {ours_rate / their_rate:.2f}")
    same = sum(a == b for a, b in zip(our_out, their_out, strict=True))
    print(f"  outputs {'identical' if same == len(prompts) else 'DIFFER'}: {same} of {len(prompts)} requests")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--equal", type=int, nargs=3, default=[8, 128, 64], metavar=("N", "LEN", "NEW"))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs of each side, taking turns; the fastest counts"
    )
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8", "fp8"))
    placement_arguments(parser)
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat: {args.repeat} must be at least 1")
    place = placement(args.device, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        v4 = write_tiny(Path(tmp) / "v4", "v4")
        vocab = load_tokenizer().get_vocab_size()
        count, length, new = args.equal
        equal = equal_prompts(count, length, vocab)
        compare(
            f"(a) {count} prompts x {length} tokens", v4, equal, new, place, args.kv_cache_dtype, args.repeat
        )
        if args.requests:
            mixed = mixed_prompts(args.requests, vocab)
            compare(f"(b) {args.requests} mixed-length requests", v4, mixed, args.max_tokens, place,
                    args.kv_cache_dtype, args.repeat)  # fmt: skip


if __name__ == "__main__":
    main()
