"""Decode steps as replayed graphs: ``batch_forward`` captured once per (capture size, width).

A step whose chunks all decode ``width`` tokens (1 + drafts) is padded to the smallest capture size
that holds it (1, 2, 4, 8, then every multiple of 8 up to ``max_num_seqs``): padding rows are
requests with no blocks whose tokens sit at position -1 (every slot -1, nothing visible), never
advanced. The forward then runs on a ``Batch`` of fixed shape (``model.cache.DecodeShape``): its
tensors are the graph's static inputs, filled each step by copies; the compressor states of the rows
are rows of the graph's own stacks; the host bookkeeping the forward defers (``Batch.after``) runs
after the replay on the tensors the graph returns. Prefill and mixed steps stay eager.

Backends: ``cuda`` (``torch.cuda.CUDAGraph``), ``npu`` (``torch.npu.NPUGraph``), ``fx``, a
``make_fx`` trace of the same step (fake tensors: nothing runs while tracing, as in a device
capture) replayed as a ``GraphModule``: the CPU proof that the step holds no host read or
data-dependent shape, through the same capture and replay code; and ``cpu``, the CPU's own graphs
(``engine.cpu_graph``: the torch references' aten ops, replayed from C++). ``eager`` runs the
fixed-shape step without a graph (what a replay must equal bit for bit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.config import EngineConfig
from model.cache import Batch, CacheLayout, DecodeShape, KVPools, SeqCache
from model.causal_lm import CausalLM
from model.compressor import CompressorState, adopt
from triton_kernels.compressor import CompressorStates

Outputs = tuple[torch.Tensor, ...]
BACKENDS = ("cuda", "npu", "cpu", "fx", "eager")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to ``max_num_seqs`` (always included)."""
    sizes = [n for n in (1, 2, 4) if n < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return [*sizes, max_num_seqs]


def bucket(sizes: list[int], rows: int) -> int | None:
    """The smallest capture size that holds ``rows`` requests; None beyond the largest."""
    return next((size for size in sizes if size >= rows), None)


def table_width(layout: CacheLayout, tokens: int) -> int:
    """Blocks of the longest block table a request of ``tokens`` tokens has, over every group."""
    return max(-(-g.slots_needed(tokens) // layout.slots_per_block[g.name]) for g in layout.groups)


def padding_seqs(pools: KVPools, count: int) -> list[SeqCache]:
    """Requests with no blocks: every slot they would read or write is -1."""
    return [SeqCache({g.name: [] for g in pools.groups}) for _ in range(count)]


@dataclass
class CapturedStep:
    """One captured shape: the static batch its graph reads, the padding rows, the graph's compressor
    stacks (with the state that owns each row) and ``replay``, which returns the step's outputs."""

    batch: Batch
    ids: torch.Tensor
    padding: list[SeqCache]
    replay: Callable[[], Outputs]
    # (owner, layer) -> the graph's stack of those states and the state that holds each of its rows
    stacks: dict[tuple[str, int], tuple[CompressorStates, list[CompressorState]]] = field(
        default_factory=dict
    )


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        pools: KVPools,
        max_num_seqs: int,
        max_tokens: int,
        backend: str,
        widths: tuple[int, ...] = (1,),
    ):
        if backend not in BACKENDS:
            raise ValueError(f"backend: {backend!r} is not one of {BACKENDS}")
        self.model, self.pools, self.backend = model, pools, backend
        self.sizes, self.widths = capture_sizes(max_num_seqs), widths
        self.max_tokens, self.max_blocks = max_tokens, table_width(pools.layout, max_tokens)
        self.device = model.embed.weight.device
        self.steps: dict[tuple[int, int], CapturedStep] = {}
        self.pool = torch.cuda.graph_pool_handle() if backend == "cuda" else None

    @classmethod
    def for_engine(
        cls, model: CausalLM, pools: KVPools, config: EngineConfig, drafts: int
    ) -> DecodeGraphs | None:
        """The graphs an engine captures (every size, plain and verifying decodes): on a device unless
        ``enforce_eager``, on the CPU when ``cpu_graphs`` asks; None otherwise."""
        kind = model.embed.weight.device.type
        wanted = kind in ("cuda", "npu") or kind == "cpu" and config.cpu_graphs
        if config.enforce_eager or not wanted:
            return None
        tokens = config.max_model_len + drafts + config.lookahead
        graphs = cls(model, pools, config.max_num_seqs, tokens, kind, (1, 1 + drafts) if drafts else (1,))
        graphs.capture_all()
        return graphs

    def capture_all(self) -> None:
        """Capture every size at every width, largest first (the smaller ones reuse its memory pool)."""
        for width in self.widths:
            for size in reversed(self.sizes):
                self.captured(DecodeShape(size, width, self.max_blocks, self.max_tokens))

    def handles(self, seqs: list[SeqCache], lengths: list[int]) -> DecodeShape | None:
        """The shape a step of these chunks replays at, None if it runs eager."""
        width = lengths[0] if lengths else 0
        size = bucket(self.sizes, len(seqs))
        fits = all(len(t) <= self.max_blocks for s in seqs for t in s.tables.values())
        fits = fits and all(s.num_tokens + width <= self.max_tokens for s in seqs)
        if width not in self.widths or set(lengths) != {width} or size is None or not fits:
            return None
        return DecodeShape(size, width, self.max_blocks, self.max_tokens)

    def run(
        self, shape: DecodeShape, seqs: list[SeqCache], ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's logits ``[T, V]`` and draft input for the real rows, through the graph of ``shape``."""
        step = self.captured(shape)
        pad = shape.rows - len(seqs)
        rows = seqs + step.padding[len(seqs) :]
        batch = Batch.build(self.pools, rows, [shape.width] * shape.rows, self.device, shape, pad)
        real = len(seqs) * shape.width
        if self.backend == "eager":
            step.ids[:real].copy_(ids)
            logits, features = self.model.batch_forward(step.ids, batch, torch.arange(len(step.ids)))
            batch.finish()
            return logits[:real], features[:real]
        self._adopt(step, rows)
        for static, value in zip(step.batch.tensors(), batch.tensors(), strict=True):
            static.copy_(value, non_blocking=True)
        step.ids[: ids.numel()].copy_(ids, non_blocking=True)
        outputs = step.replay()
        at, effects = 2, []
        for effect, tensors in step.batch.effects:
            effects.append((effect, outputs[at : at + len(tensors)]))
            at += len(tensors)
        batch.finish(effects)
        return outputs[0][:real].clone(), outputs[1][:real].clone()

    def captured(self, shape: DecodeShape) -> CapturedStep:
        key = (shape.rows, shape.width)
        if key not in self.steps:
            self.steps[key] = self._capture(shape)
        return self.steps[key]

    def _capture(self, shape: DecodeShape) -> CapturedStep:
        padding = padding_seqs(self.pools, shape.rows)
        tokens = shape.rows * shape.width
        batch = Batch.build(self.pools, padding, [shape.width] * shape.rows, self.device, shape, shape.rows)
        ids = torch.zeros(tokens, dtype=torch.long, device=self.device)
        rows = torch.arange(tokens, device=self.device)
        model = self.model

        def forward() -> Outputs:
            batch.effects, batch.shared = [], {}  # what this run records, and builds, is its own
            logits, features = model.batch_forward(ids, batch, rows)
            return logits, features, *(t for _, tensors in batch.effects for t in tensors)

        with torch.no_grad():
            forward()  # creates the padding rows' states (their stacks become the graph's) and warms up
            replay = forward if self.backend == "eager" else self._record(forward)
        step = CapturedStep(batch, ids, padding, replay)
        for owner in ("compressors", "indexers"):
            for layer, state in getattr(padding[0], owner).items():
                step.stacks[owner, layer] = state.stack, [getattr(s, owner)[layer] for s in padding]
        return step

    def _record(self, forward: Callable[[], Outputs]) -> Callable[[], Outputs]:
        if self.backend == "fx":
            from torch.fx.experimental.proxy_tensor import make_fx

            return make_fx(forward, tracing_mode="fake", _allow_non_fake_inputs=True)()
        if self.backend == "cpu":
            from engine import cpu_graph

            return cpu_graph.record(forward)
        graph = torch.cuda.CUDAGraph() if self.backend == "cuda" else torch.npu.NPUGraph()
        context = (
            torch.cuda.graph(graph, pool=self.pool) if self.backend == "cuda" else torch.npu.graph(graph)
        )
        with context:
            outputs = forward()

        def replay() -> Outputs:
            graph.replay()
            return outputs

        return replay

    def _adopt(self, step: CapturedStep, rows: list[SeqCache]) -> None:
        """Each row's compressor states become that row of the graph's stacks."""
        for (owner, layer), (stack, owners) in step.stacks.items():
            adopt([getattr(s, owner)[layer] for s in rows], stack, owners)
