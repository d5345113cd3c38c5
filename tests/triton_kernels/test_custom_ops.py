"""The custom ops: a decode step through them equals the direct calls bit for bit, every op's fake
implementation and declared mutations agree with its real one (``torch.library.opcheck`` on the
arguments a decode step gives it), and each op appears in a ``make_fx`` trace as one node."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

from tests.engine.test_decode_step import decoding
from triton_kernels import custom_ops


class OpCalls(TorchDispatchMode):
    """The first arguments of every ``dsv4`` op dispatched, by op."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[torch._ops.OpOverload, tuple] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "dsv4" and func not in self.calls:
            clone = lambda t: t.clone() if isinstance(t, torch.Tensor) else t  # noqa: E731
            self.calls[func] = tuple(
                [clone(a) for a in arg] if isinstance(arg, list) else clone(arg) for arg in args
            )
        return func(*args, **(kwargs or {}))


def step_logits(arch: str, through_ops: bool, monkeypatch: pytest.MonkeyPatch, hook=None) -> torch.Tensor:
    engine = decoding(arch, (3, 9, 17, 30))
    model, seen = engine.runner.model, []
    forward = model.batch_forward

    def recorded(*args):
        monkeypatch.setattr(custom_ops, "tracing", lambda whole=False: through_ops)
        try:
            with hook or torch.no_grad():
                seen.append(forward(*args))
        finally:
            monkeypatch.undo()
        return seen[-1]

    model.batch_forward = recorded
    engine.step()
    return seen[0][0]


@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_decode_step_through_the_ops_equals_the_direct_calls(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    direct = step_logits(arch, False, monkeypatch)
    hook = OpCalls()
    through = step_logits(arch, True, monkeypatch, hook)
    assert torch.equal(direct, through)
    names = {op.name() for op in hook.calls}
    assert {"dsv4::rms_norm", "dsv4::sparse_attention", "dsv4::compress", "dsv4::hc_update"} <= names
    for op, args in hook.calls.items():
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_an_op_is_one_node_of_a_trace() -> None:
    x, weight = torch.randn(4, 8), torch.rand(8)
    graph = make_fx(lambda x: custom_ops.rms_norm(x, weight, 1e-6) * 2)(x)
    called = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert called == [torch.ops.dsv4.rms_norm.default, torch.ops.aten.mul.Tensor]
    assert torch.equal(graph(x), custom_ops.rms_norm(x, weight, 1e-6) * 2)
