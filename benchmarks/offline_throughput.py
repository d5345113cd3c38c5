"""Offline throughput of the engine next to transformers, and V4.1 decode step time against context.

``python -m benchmarks.offline_throughput [--equal 8 128 64] [--requests 64] [--max-tokens 16]
[--contexts 1024 4096 16384]``

1. Output tokens/s of ``LLMEngine`` on the tiny V4 checkpoint for equal prompts (8 x 128 tokens, 64 new
   each by default) next to transformers' batched ``DeepseekV4ForCausalLM.generate`` over the same
   prompts (one ``[8, 128]`` batch: equal lengths need no padding), both greedy; the ratio, and whether
   the outputs are identical.
2. The same for requests of mixed lengths, transformers one request at a time (its V4 cache has no
   padding support, so batching them is not an option).
3. The decode step time of the tiny V4.1 at several context lengths: with sparse attention and the
   two-level indexer it should stay nearly flat.
Both are measured side by side in one run; the numbers are for this machine only.
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
from model.checkpoint import load_model, read_tensors
from model.hf_names import to_transformers
from model.tiny import write_tiny
from model.tokenizer import load_tokenizer


def mixed_prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 512, (count,), generator=gen).tolist()
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def equal_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=gen).tolist()


def engine_throughput(path: Path, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    engine = LLMEngine(load_model(path), load_tokenizer(path), EngineConfig(max_num_batched_tokens=2048))
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
    path: Path, prompts: list[list[int]], max_tokens: int, batched: bool
) -> tuple[float, list[list[int]]]:
    """Greedy ``generate``: all prompts as one batch (``batched``, equal lengths) or one at a time."""
    model = transformers_model(path)
    groups = [prompts] if batched else [[p] for p in prompts]
    outputs = []
    start = time.perf_counter()
    with torch.no_grad():
        for group in groups:
            out = model.generate(torch.tensor(group), max_new_tokens=max_tokens, do_sample=False)
            outputs += out[:, len(group[0]) :].tolist()
    return time.perf_counter() - start, outputs


def compare(label: str, path: Path, prompts: list[list[int]], max_tokens: int, batched: bool) -> None:
    ours, our_out = engine_throughput(path, prompts, max_tokens)
    theirs, their_out = transformers_throughput(path, prompts, max_tokens, batched)
    ours_rate = sum(map(len, our_out)) / ours
    their_rate = sum(map(len, their_out)) / theirs
    mode = "batched" if batched else "one request at a time"
    print(f"tiny V4, {label}, {max_tokens} new tokens each, greedy:")
    print(f"  engine        {ours_rate:8.1f} output tok/s ({ours:.1f} s)")
    print(f"  transformers  {their_rate:8.1f} output tok/s ({theirs:.1f} s, {mode})")
    print(f"  ratio engine / transformers = {ours_rate / their_rate:.2f}")
    same = sum(a == b for a, b in zip(our_out, their_out, strict=True))
    print(f"  outputs {'identical' if same == len(prompts) else 'DIFFER'}: {same} of {len(prompts)} requests")


def decode_step_ms(path: Path, context: int, steps: int = 8) -> float:
    model = load_model(path)
    ids = torch.randint(
        3, model.cfg.vocab_size, (context + steps,), generator=torch.Generator().manual_seed(1)
    )
    state = model.new_state()
    with torch.no_grad():
        for start in range(0, context, 512):  # chunked prefill keeps the scorers' [T, H, E] temporaries small
            model(ids[start : min(context, start + 512)], state, last_only=True)
        begin = time.perf_counter()
        for t in range(context, context + steps):
            model(ids[t : t + 1], state, last_only=True)
    return (time.perf_counter() - begin) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--equal", type=int, nargs=3, default=[8, 128, 64], metavar=("N", "LEN", "NEW"))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--contexts", type=int, nargs="*", default=[1024, 4096, 16384])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        v4, v41 = write_tiny(Path(tmp) / "v4", "v4"), write_tiny(Path(tmp) / "v41", "v41")
        vocab = load_tokenizer().get_vocab_size()
        count, length, new = args.equal
        compare(f"{count} prompts x {length} tokens", v4, equal_prompts(count, length, vocab), new, True)
        if args.requests:
            mixed = mixed_prompts(args.requests, vocab)
            compare(f"{args.requests} mixed requests", v4, mixed, args.max_tokens, False)
        print("tiny V4.1 decode step time (one request):")
        for context in args.contexts:
            print(f"  context {context:6d}: {decode_step_ms(v41, context):7.1f} ms/step")


if __name__ == "__main__":
    main()
