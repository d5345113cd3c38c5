"""Tensor parallelism with expert parallelism inside the group (design "Parallelism", stage A).

``shard_model`` rewrites a model built on ``meta`` into one rank's share and returns the ``ShardPlan``
the loader follows: which slice of each checkpoint tensor this rank reads, and which tensors belong to
other ranks. Per attention layer the query heads (``wq_b``, ``attn_sink``) and the output groups
(``wo_a``) are split, ``wo_b`` is row-parallel (its input split) and all-reduced; per MoE block each
rank owns E/N routed experts and 1/N of the shared expert's intermediate width, and the block's output
is all-reduced once. Embedding and head are split over the vocabulary. Everything else (``wq_a``,
``wkv``, norms, compressors, indexers, mHC, Engram, gates with ``tid2eid``) is replicated, so every
rank computes identical caches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from model.attention import SharedKVAttention
from model.config import ModelConfig
from model.moe import Expert, Gate, MoE
from model.quant_linear import BIAS_COLUMNS, DenseLinear, StackedExperts
from model.shards import StoredTensor

# A routed expert projection's checkpoint tensors, in any stored format (FP8 / MXFP4, W8A8, W4A8).
EXPERT_TENSORS = ("weight", "scale", "weight_scale", "weight_offset", "scale_bias")


@dataclass(frozen=True)
class ParallelContext:
    """This process's place in the group (``group`` None: the default group); ``data_parallel``: the ranks
    hold whole replicated models but for the routed experts, split over them (stage B)."""

    rank: int = 0
    world: int = 1
    group: dist.ProcessGroup | None = None
    data_parallel: bool = False

    def span(self, total: int, what: str) -> tuple[int, int]:
        """This rank's ``[start, stop)`` of ``total`` items split evenly over the group."""
        if total % self.world:
            raise ValueError(f"{what}={total} does not divide over {self.size_name}={self.world}")
        share = total // self.world
        return self.rank * share, (self.rank + 1) * share

    @property
    def size_name(self) -> str:
        return "data_parallel_size" if self.data_parallel else "tensor_parallel_size"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x`` concatenated along the last dimension, in rank order."""
        if self.world == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class TensorSlice:
    dim: int
    start: int
    stop: int

    def take(self, t: torch.Tensor) -> torch.Tensor:
        return t.narrow(self.dim, self.start, self.stop - self.start)

    def blocks(self, block: int, name: str) -> TensorSlice:
        """The slice of a block-scale tensor that scales this slice of its weight: it must start and end on
        block boundaries (a block's one scale cannot be shared by two ranks)."""
        if self.start % block or self.stop % block:
            raise ValueError(
                f"{name}: the rank's slice [{self.start}, {self.stop}) of dimension {self.dim} does not fall "
                f"on the FP8 block of {block}"
            )
        return TensorSlice(self.dim, self.start // block, self.stop // block)

    def read_into(self, entry: StoredTensor, target: torch.Tensor) -> None:
        """Read this slice of a stored tensor into ``target`` of its dtype: a row slice is one contiguous
        byte range of the file; other slices read the tensor (host peak: one tensor) and cut it."""
        if self.dim != 0:
            target.copy_(self.take(entry.read()))
            return
        row_bytes = entry.nbytes // entry.shape[0]
        rows = StoredTensor(
            entry.name,
            entry.file,
            entry.dtype,
            (self.stop - self.start, *entry.shape[1:]),
            entry.start + self.start * row_bytes,
            (self.stop - self.start) * row_bytes,
        )
        rows.read_into(target)


@dataclass
class ShardPlan:
    """What one rank loads: ``slices`` of the split tensors, and ``elsewhere``, other ranks' tensors."""

    context: ParallelContext
    slices: dict[str, TensorSlice] = field(default_factory=dict)
    elsewhere: set[str] = field(default_factory=set)
    row_parallel: list[str] = field(default_factory=list)  # linears whose partial outputs are all-reduced


def connect(model: nn.Module, plan: ShardPlan) -> None:
    """Attach the collectives to the split linears once the loader has swapped in their final (dense or
    packed) class: row-parallel outputs are summed over the ranks in fp32, the head's logits gathered."""
    context = plan.context

    def reduce(_module: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        return context.all_reduce(out.float()).to(out.dtype)

    for name in plan.row_parallel:
        model.get_submodule(name).register_forward_hook(reduce)
    if not context.data_parallel:  # a data-parallel rank's head is whole
        model.head.register_forward_hook(lambda _module, _args, out: context.all_gather(out))


class VocabParallelEmbedding(nn.Embedding):
    """Rows ``[start, stop)`` of the vocabulary; ids elsewhere look up zeros, and the sum over ranks is the
    plain lookup exactly (one nonzero term per token)."""

    def __init__(self, start: int, stop: int, dim: int, context: ParallelContext):
        super().__init__(stop - start, dim)
        self.start, self.context = start, context

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(torch.where(mine, local, 0), self.weight) * mine.unsqueeze(-1)
        return self.context.all_reduce(out.float()).to(out.dtype)  # fp32 on the wire: any backend sums it


class LocalExperts(StackedExperts):
    """The routed experts ``[first, first + count)`` of a layer, stacked in their stored format and named
    as the checkpoint names them; choices of other experts are shifted outside ``[0, count)``, so
    ``moe_gemm`` sorts them after the last expert and never computes them."""

    def __init__(self, first: int, count: int, shape: tuple, *args: object):
        _, hidden, inter, limit = shape
        super().__init__(count, hidden, inter, limit, *args)
        self.first, self.shape = first, shape

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        local: dict[str, torch.Tensor] = {}
        super()._save_to_state_dict(local, "", keep_vars)
        for name, t in local.items():
            e, _, rest = name.partition(".")
            destination[f"{prefix}{int(e) + self.first}.{rest}"] = t

    def forward(self, x: torch.Tensor, picked: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return super().forward(x, picked - self.first, weights)

    def pack(self, fmt: str, block: int = 1, bias_columns: tuple[int, ...] = BIAS_COLUMNS) -> LocalExperts:
        return LocalExperts(self.first, self.dims[0], self.shape, fmt, block, bias_columns)


class ExpertParallelMoE(nn.Module):
    """A MoE block's share on one rank: the replicated gate, the routed experts ``[start, stop)`` (a token
    is computed here only for the experts of this rank it is routed to) and a slice of the shared
    expert's intermediate width; the partial sums of both are all-reduced once."""

    def __init__(
        self, gate: Gate, experts: range, shared: Expert | None, shape: tuple, context: ParallelContext
    ):
        """``shape``: the block's ``MoE.shape``, (experts, hidden, intermediate, clamp limit)."""
        super().__init__()
        self.gate, self.context = gate, context
        self.experts = LocalExperts(experts.start, len(experts), shape)
        self.shared_experts = shared

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        picked, weights = self.gate(x, ids)
        out = self.experts(x, picked, weights)
        if self.shared_experts is not None:
            out += self.shared_experts(x).float()
        return self.context.all_reduce(out).to(x.dtype)


class DispatchMoE(ExpertParallelMoE):
    """Stage B's MoE block: each data-parallel rank routes its own tokens with the replicated gate, sends
    every (token, expert) choice to the rank owning the expert (all-to-all: the counts first, then the
    rows), computes the choices it received with its ``LocalExperts`` and sends the weighted results back
    (all-to-all), where each token sums its ``k`` results in slot order, as one process does. A rank with
    no tokens still takes part with empty rows, so every rank runs the same collectives."""

    def __init__(self, *args: object):
        """As ``ExpertParallelMoE``, with the whole shared expert."""
        super().__init__(*args)
        self.per_rank = self.experts.w1.shape[0]
        self.pairs_computed = 0  # (token, expert) choices this rank's experts computed, for the checks

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        picked, weights = self.gate(x, ids)
        t, k = picked.shape
        owner = (picked // self.per_rank).reshape(-1)
        order = torch.argsort(owner, stable=True)
        sent = torch.bincount(owner, minlength=self.context.world)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=self.context.group)
        sent_sizes, received_sizes = sent.tolist(), received.tolist()  # the payload's split sizes
        # One fp32 row per choice: the token's hidden state, its expert and its routing weight (exact).
        rows = torch.cat([x.float()[order // k], picked.reshape(-1, 1)[order].float(),
                          weights.reshape(-1, 1)[order]], dim=1)  # fmt: skip
        inbox = rows.new_empty(sum(received_sizes), rows.shape[1])
        dist.all_to_all_single(inbox, rows, received_sizes, sent_sizes, group=self.context.group)
        self.pairs_computed += inbox.shape[0]
        hidden = inbox[:, :-2].to(x.dtype)
        results = self.experts(hidden, inbox[:, -2:-1].long(), inbox[:, -1:]).float()
        back = results.new_empty(t * k, x.shape[1])
        dist.all_to_all_single(back, results, sent_sizes, received_sizes, group=self.context.group)
        out = torch.empty_like(back)
        out[order] = back
        out = out.view(t, k, x.shape[1]).sum(1)
        if self.shared_experts is not None:
            out += self.shared_experts(x).float()
        return out.to(x.dtype)


def idle_step(model: nn.Module, layers: nn.Module | None = None) -> None:
    """A data-parallel rank with nothing scheduled: the MoE blocks of one forward through ``layers`` (the
    backbone's by default, or a draft head's) dispatch zero tokens, in forward order, so the other ranks'
    all-to-alls find it (the collectives are the only thing that must match)."""
    weight = model.embed.weight
    empty = torch.empty(0, model.cfg.hidden_size, dtype=weight.dtype, device=weight.device)
    ids = torch.empty(0, dtype=torch.long, device=weight.device)
    for module in (model.layers if layers is None else layers).modules():
        if isinstance(module, DispatchMoE):
            module(empty, ids)


def check_divisible(cfg: ModelConfig, world: int, data_parallel: bool = False) -> None:
    """Fail before any process starts when the model does not split over ``world`` ranks (data parallel:
    only the routed experts are split)."""
    size = ParallelContext(0, 1, data_parallel=data_parallel).size_name
    if world < 1:
        raise ValueError(f"{size}={world} must be at least 1")
    counts = (
        {"n_routed_experts": cfg.n_routed_experts}
        if data_parallel
        else {
            "num_attention_heads": cfg.num_attention_heads,
            "o_groups": cfg.o_groups,
            "n_routed_experts": cfg.n_routed_experts,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "vocab_size": cfg.vocab_size,
        }
    )
    if bad := {name: n for name, n in counts.items() if n % world}:
        named = ", ".join(f"{name}={n}" for name, n in bad.items())
        raise ValueError(f"{size}={world} does not divide {named}")


def shard_model(model: nn.Module, context: ParallelContext) -> ShardPlan:
    """Replace, on ``meta``, the split modules of ``model`` by this rank's share (checkpoint names kept);
    ``connect`` then attaches the collectives of the linears."""
    cfg, plan = model.cfg, ShardPlan(context)
    check_divisible(cfg, context.world, context.data_parallel)
    with torch.device("meta"):
        if context.data_parallel:
            for prefix, module in list(model.named_modules()):
                if isinstance(module, MoE):
                    replace_module(model, prefix, _dispatch_moe(prefix, module, plan))
            return plan
        for prefix, module in list(model.named_modules()):
            if isinstance(module, SharedKVAttention):
                _shard_attention(prefix, module, plan)
            elif isinstance(module, MoE):
                replace_module(model, prefix, _shard_moe(prefix, module, plan))
        start, stop = _split(plan, "embed.weight", 0, cfg.vocab_size, "vocab_size")
        model.embed = VocabParallelEmbedding(start, stop, cfg.hidden_size, context)
        _split(plan, "head.weight", 0, cfg.vocab_size, "vocab_size")
        model.head = DenseLinear(cfg.hidden_size, stop - start)
    return plan


def _split(plan: ShardPlan, name: str, dim: int, total: int, what: str) -> tuple[int, int]:
    start, stop = plan.context.span(total, what)
    plan.slices[name] = TensorSlice(dim, start, stop)
    return start, stop


def _shard_attention(prefix: str, attn: SharedKVAttention, plan: ShardPlan) -> None:
    heads, groups, d = attn.heads, attn.groups, attn.head_dim
    per_group = attn.wo_a.out_features // groups  # o_lora_rank
    h0, h1 = _split(plan, f"{prefix}.attn_sink", 0, heads, "num_attention_heads")
    plan.slices[f"{prefix}.wq_b.weight"] = TensorSlice(0, h0 * d, h1 * d)
    g0, g1 = plan.context.span(groups, "o_groups")
    plan.slices[f"{prefix}.wo_a.weight"] = TensorSlice(0, g0 * per_group, g1 * per_group)
    plan.slices[f"{prefix}.wo_b.weight"] = TensorSlice(1, g0 * per_group, g1 * per_group)
    attn.heads, attn.groups = h1 - h0, g1 - g0
    attn.wq_b = DenseLinear(attn.wq_b.in_features, attn.heads * d)
    attn.attn_sink = nn.Parameter(torch.empty(attn.heads))
    attn.wo_a = DenseLinear(attn.wo_a.in_features, attn.groups * per_group)
    attn.wo_b = DenseLinear(attn.groups * per_group, attn.wo_b.out_features)
    plan.row_parallel.append(f"{prefix}.wo_b")


def _owned_experts(prefix: str, moe: MoE, plan: ShardPlan) -> range:
    """This rank's routed experts; the others' tensors are marked as read elsewhere."""
    experts = moe.shape[0]
    e0, e1 = plan.context.span(experts, "n_routed_experts")
    for e in (*range(e0), *range(e1, experts)):
        plan.elsewhere.update(
            f"{prefix}.experts.{e}.{w}.{t}" for w in ("w1", "w2", "w3") for t in EXPERT_TENSORS
        )
    return range(e0, e1)


def _dispatch_moe(prefix: str, moe: MoE, plan: ShardPlan) -> DispatchMoE:
    owned = _owned_experts(prefix, moe, plan)
    return DispatchMoE(moe.gate, owned, moe.shared_experts, moe.shape, plan.context)


def _shard_moe(prefix: str, moe: MoE, plan: ShardPlan) -> ExpertParallelMoE:
    _, hidden, inter, limit = moe.shape
    owned = _owned_experts(prefix, moe, plan)
    shared = None
    if moe.shared_experts is not None:
        i0, i1 = _split(plan, f"{prefix}.shared_experts.w1.weight", 0, inter, "moe_intermediate_size")
        plan.slices[f"{prefix}.shared_experts.w3.weight"] = TensorSlice(0, i0, i1)
        plan.slices[f"{prefix}.shared_experts.w2.weight"] = TensorSlice(1, i0, i1)
        # Its w2 stays a plain linear: the partial output joins the routed experts' before the one reduce.
        shared = Expert(hidden, i1 - i0, limit)
    return ExpertParallelMoE(moe.gate, owned, shared, moe.shape, plan.context)


def replace_module(model: nn.Module, prefix: str, module: nn.Module) -> None:
    """Put ``module`` where ``model`` holds the submodule named ``prefix``."""
    parent, _, leaf = prefix.rpartition(".")
    setattr(model.get_submodule(parent), leaf, module)
