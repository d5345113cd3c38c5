"""Tensor parallelism with expert parallelism inside the group (design "Parallelism", stage A).

``shard_model`` rewrites a model built on ``meta`` into one rank's share and returns the ``ShardPlan``
the loader follows: which slice of each checkpoint tensor this rank reads, and which tensors belong to
other ranks. Per attention layer the query heads (``wq_b``, ``attn_sink``) and the output groups
(``wo_a``) are split, ``wo_b`` is row-parallel (its input split) and all-reduced; per MoE block each
rank owns E/N routed experts and 1/N of the shared expert's intermediate width, and the block's output
is all-reduced once. Embedding and head are split over the vocabulary. Everything else (``wq_a``,
``wkv``, norms, compressors, indexers, mHC, Engram, gates with ``tid2eid``) is replicated, so every
rank computes identical caches. Under data parallelism (stage B) only the routed experts are split, and
each MoE block becomes a ``DispatchMoE``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from model.attention import SharedKVAttention
from model.config import ModelConfig
from model.moe import Expert, MoE
from model.parallel.context import ParallelContext
from model.parallel.modules import DispatchMoE, ExpertParallelMoE, VocabParallelEmbedding
from model.quant_linear import DenseLinear
from model.shards import TensorSlice

# A routed expert projection's checkpoint tensors, in any stored format (FP8 / MXFP4, W8A8, W4A8).
EXPERT_TENSORS = ("weight", "scale", "weight_scale", "weight_offset", "scale_bias")


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
