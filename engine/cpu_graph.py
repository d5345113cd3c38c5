"""The CPU's decode graphs: a decode step recorded once as aten ops and replayed from C++.

A toy model's step on the CPU is dispatch-bound: its torch references spend as long in Python as in
their ops. ``record`` traces the step with ``make_fx`` on fake tensors (nothing runs, as in a device
capture) while the custom ops inline their references (``inline_references``): the graph holds the
references' own aten ops, except the few it keeps whole, one op each (``compress``, whose reference
finds its windows on the host, among them). TorchScript then replays those ops with no optimisation
pass (no fusion, no reordering): each runs as eager runs it, so a replay equals the eager step bit for
bit, without the Python around the ops.

``torch.jit.trace`` is deprecated upstream, without a successor that replays aten ops as they are
(``torch.compile`` fuses and reorders them, which changes the rounding); torch is pinned, and the
replay tests fail if it stops working.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from triton_kernels.custom_ops import RECORDED, inline_references

Outputs = tuple[torch.Tensor, ...]

# aten's view.dtype (a bitcast view) as TorchScript can replay it: its tracer records the dtype as an int,
# which its alias analysis then matches to no overload of aten::view.
_LIB = torch.library.Library("dsv4_cpu_graph", "DEF")
_LIB.define("view_dtype(Tensor(a) self, ScalarType dtype) -> Tensor(a)")
_LIB.impl("view_dtype", lambda x, dtype: x.view(dtype), "CompositeExplicitAutograd")
# Ours only while a trace records (its fake implementation); a replay calls aten's, with no Python between.
_AS_ATEN = {torch.ops.dsv4.grouped_mm.default: torch.ops.aten._grouped_mm.default}


def record(forward: Callable[[], Outputs]) -> Callable[[], Outputs]:
    """``forward`` (no inputs: it reads static tensors) as a replay of its recorded aten ops."""
    try:
        with inline_references():
            traced = make_fx(forward, RECORDED, tracing_mode="fake", _allow_non_fake_inputs=True)()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*torch\.jit\.trace", category=DeprecationWarning)
            script = torch.jit.trace(replayable(static(traced)), (), check_trace=False)
    except Exception as error:
        raise RuntimeError(f"cpu_graphs: the decode step does not record as a CPU graph: {error}") from error

    def replay() -> Outputs:
        # Below autograd and the in-place/view bookkeeping (a graph records none; the version counters
        # the references' caches read are bumped outside, where the step's inputs are copied in): each
        # op goes straight to its CPU kernel, with the values it computes otherwise (12% of a tiny step).
        # On one thread: the step's ops are small (a graph pays off where dispatch dominates), and the
        # intra-op pool's hand-offs cost more than they save there (tiny V4 step: 8.0 -> 6.3 ms).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.jit.optimized_execution(False), torch._C._AutoDispatchBelowADInplaceOrView():
                return script()
        finally:
            torch.set_num_threads(threads)

    return replay


def static(traced: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``traced``, refused where a size in it depends on the data: a replay would keep the traced size."""
    for node in traced.graph.nodes:
        if free_unbacked_symbols(node.meta.get("val")):
            raise RuntimeError(f"decode step: {node.format_node()} has a data-dependent size, not replayable")
    return traced


def replayable(traced: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``traced`` as TorchScript replays it best: without the ops whose results nothing reads, the tensors
    made from numbers alone made once (``fold_constants``), the ops recorded as ours for their fake
    implementation alone (``RECORDED``) as aten's own, each Python number given to a ``.Tensor`` overload
    (``x.add_(eps)``) given to its ``.Scalar`` one instead, which aten runs as the same call (TorchScript
    would store the number as a tensor and convert it at every replay), and ``view.dtype`` as ours."""
    traced.graph.eliminate_dead_code()  # keeps every op that writes (fx counts them impure)
    fold_constants(traced)
    for node in traced.graph.nodes:
        target, args = node.target, node.args
        if target == torch.ops.aten.view.dtype:
            node.target = torch.ops.dsv4_cpu_graph.view_dtype.default
        if target in _AS_ATEN:
            node.target, node.args, node.kwargs = _AS_ATEN[target], args[:2], {"offs": args[2]}
        if not isinstance(target, torch._ops.OpOverload) or target._overloadname != "Tensor" or len(args) < 2:
            continue
        scalar = getattr(target.overloadpacket, "Scalar", None)
        if scalar is not None and isinstance(args[1], int | float) and isinstance(args[0], torch.fx.Node):
            node.target = scalar
    traced.recompile()
    return traced


_MADE_FROM_NUMBERS = {
    torch.ops.aten.arange.default,
    torch.ops.aten.arange.start,
    torch.ops.aten.arange.start_step,
    torch.ops.aten.scalar_tensor.default,
    torch.ops.aten.full.default,
}


def fold_constants(traced: torch.fx.GraphModule) -> None:
    """The tensors the step makes from numbers alone (its aranges, the scalars of its ``where``), made
    once here and read by every replay, where no op writes them (or a view of them)."""
    for node in list(traced.graph.nodes):
        if node.target not in _MADE_FROM_NUMBERS or _written(node):
            continue
        name = f"_folded_{node.name}"
        traced.register_buffer(name, node.target(*node.args, **node.kwargs))
        with traced.graph.inserting_before(node):
            node.replace_all_uses_with(traced.graph.get_attr(name))
        traced.graph.erase_node(node)


def _written(node: torch.fx.Node) -> bool:
    """Some op writes ``node``'s tensor, directly or through a view of it."""
    for user in node.users:
        if not isinstance(user.target, torch._ops.OpOverload):
            return True  # not an aten op: assume it may
        schema = user.target._schema
        for arg, spec in zip(user.args, schema.arguments, strict=False):
            if arg is node and spec.alias_info is not None and spec.alias_info.is_write:
                return True
        views = any(r.alias_info is not None for r in schema.returns)
        if views and _written(user):
            return True
    return False
