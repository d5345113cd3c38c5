"""Launches per layer of one decode step on the device path, counted under the Triton interpreter.

``python -m benchmarks.decode_launches [--arch v4 v41] [--requests 2 8]``

Every operator runs its Triton kernel (``DSV4_TRITON_ON_CPU=1`` with ``TRITON_INTERPRET=1``), as on an
NPU or a GPU. A launch is a Triton kernel launch or an aten operator dispatched outside one, views and
allocations excepted: they launch nothing on a device (an allocation is the caching allocator's host
bookkeeping, and a replayed graph makes none), inside ``batch_forward`` of one decode step of
``--requests`` requests (prompts of different lengths, one token each). Printed per layer, the total
over the backbone's layers divided by their count, for the plain eager step and for the step of
fixed shape that decode graphs capture (what one replay launches on the device). The counts must not
grow with the requests; each row says so.

``--steps cpu`` counts the same eager step on the CPU path instead (the torch references, no kernel):
every aten operator it dispatches, views and allocations included, since each costs the host a dispatch
(a few microseconds) and a tiny model's CPU step is made of them: the lever on CPU speed, counted
exactly where timings on a shared machine are not.
"""

from __future__ import annotations

import argparse
import os
from collections import Counter

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("DSV4_CHECK_RANGES", "0")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton.runtime.interpreter import GridExecutor  # noqa: E402

from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.request import SamplingParams  # noqa: E402
from model.checkpoint import load_model  # noqa: E402
from model.testing.tiny import cached_tiny  # noqa: E402
from model.tokenizer import load_tokenizer  # noqa: E402

LENGTHS = (5, 29, 13, 21, 9, 33, 17, 25)  # 1 mod 4, below 127: the same windows close in every batch
STEPS = {
    "eager": "eager: launches",
    "fixed": "fixed-shape (graph): launches",
    "cpu": "cpu references: aten operators",
}


# Operators that only allocate or reinterpret memory (``_unsafe_view`` is a view torch does not mark as one).
NO_LAUNCH = frozenset(
    f"aten.{op}"
    for op in ("empty.memory_format", "empty_like.default", "empty_strided.default", "new_empty.default",
               "_unsafe_view.default")
)  # fmt: skip


class Launches(TorchDispatchMode):
    """Triton launches and the aten operators dispatched outside them, while ``active`` (``every_op``: views
    and allocations too)."""

    def __init__(self, every_op: bool = False) -> None:
        super().__init__()
        self.active, self.inside, self.ops, self.every_op = False, 0, Counter(), every_op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        launches = self.every_op or (not func.is_view and str(func) not in NO_LAUNCH)
        if self.active and not self.inside and launches:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def counting(hook: Launches):
    launch = GridExecutor.__call__

    def run(self, *args, **kwargs):
        if hook.active and not hook.inside:
            hook.ops[f"triton:{self.fn.__name__}"] += 1
        hook.inside += 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            hook.inside -= 1

    return run


def decode_step(arch: str, requests: int, step: str) -> tuple[Counter, int]:
    """Launches of one decode step (``eager``, ``fixed`` shape, or ``cpu``: the aten operators of the
    reference path) of ``requests`` requests, and the backbone's layer count."""
    fixed = step == "fixed"
    path = cached_tiny(arch)
    model = load_model(path)
    config = EngineConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=128)
    engine = LLMEngine(model, load_tokenizer(path), config)
    runner = engine.runner
    if fixed:
        from engine.decode_graphs import DecodeGraphs

        runner.graphs = DecodeGraphs(model, runner.pools, 8, 128, "eager")
    gen = torch.Generator().manual_seed(3)
    for n in LENGTHS[:requests]:
        prompt = torch.randint(3, model.cfg.vocab_size, (n,), generator=gen).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0))
    engine.step()
    if fixed:
        engine.step()  # the first decode step builds the shape's padding rows: count a later one
    hook, forward = Launches(every_op=step == "cpu"), model.batch_forward

    def watched(*args):
        hook.active = True
        try:
            return forward(*args)
        finally:
            hook.active = False

    model.batch_forward = watched
    # Only the counted step runs on the kernels (the interpreter is slow: the prefill runs the references).
    launch, GridExecutor.__call__ = GridExecutor.__call__, counting(hook)
    if step != "cpu":
        os.environ["DSV4_TRITON_ON_CPU"] = "1"
    try:
        with hook:
            engine.step()
    finally:
        GridExecutor.__call__ = launch
        os.environ.pop("DSV4_TRITON_ON_CPU", None)
    return hook.ops, len(model.layers)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", nargs="+", default=["v4", "v41"])
    parser.add_argument("--requests", nargs="+", type=int, default=[2, 8])
    parser.add_argument("--steps", nargs="+", choices=list(STEPS), default=list(STEPS))
    parser.add_argument("--top", type=int, default=0, help="also list the N most launched operators")
    args = parser.parse_args()
    for arch in args.arch:
        for step in args.steps:
            counts = {n: decode_step(arch, n, step) for n in args.requests}
            per_layer = {n: sum(ops.values()) / layers for n, (ops, layers) in counts.items()}
            kernels = {n: sum(c for op, c in ops.items() if op.startswith("triton:")) / layers
                       for n, (ops, layers) in counts.items()}  # fmt: skip
            same = len({sum(ops.values()) for ops, _ in counts.values()}) == 1
            triton = "" if step == "cpu" else " ({:.1f} Triton)"
            cells = ", ".join(
                f"{n} requests {per_layer[n]:.1f}" + triton.format(kernels[n]) for n in per_layer
            )
            print(f"{arch} {STEPS[step]} per layer: {cells}; {'constant' if same else 'GROWS'} in requests")
            if args.top:
                ops, _ = counts[max(counts)]
                print("  " + ", ".join(f"{op} {c}" for op, c in ops.most_common(args.top)))


if __name__ == "__main__":
    main()
