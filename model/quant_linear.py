"""Linear layers whose weights stay in the checkpoint's stored format (model-spec §9.1, §9.5).

Every linear of the model is built as a ``DenseLinear``; the loader swaps one for a ``PackedLinear``
(``Fp8Linear``, ``Mxfp4Linear``, ``Int8Linear``) while the model is still on ``meta`` when the
checkpoint stores it quantised, so the stored bytes and scales are the module's buffers, under the
checkpoint's own names (``X.weight`` / ``X.scale``, msModelSlim's ``X.weight_scale`` /
``X.weight_offset``). The forward is ``triton_kernels.quant_matmul``: the Triton kernel on a device,
its torch reference on the CPU, which decodes one tile of rows at a time (the weight stays packed).
``StackedExperts`` holds a MoE layer's routed experts, of any format, stacked for ``moe_gemm``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from triton_kernels.custom_ops import moe_gemm, quant_matmul
from triton_kernels.moe_gemm import RoutedExperts
from triton_kernels.quant_matmul import (
    DENSE,
    FP8,
    INT4,
    INT8,
    MXFP4,
    MXFP4_GROUP,
    QuantWeight,
    dense_weight,
    fp8_weight,
    int4_weight,
    int8_weight,
    mxfp4_weight,
)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


class DenseLinear(nn.Linear):
    """The family's dense member: a bias-free bf16 / fp32 ``nn.Linear``."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, G, in]``, group ``g`` projected by row block ``g`` of the weight: ``[T, G, out / G]``."""
        weight = self.weight.view(x.shape[1], -1, x.shape[-1])
        out = x.new_empty(x.shape[0], x.shape[1], weight.shape[1])
        # One batched GEMM, written through the transposed view: the [T, G, out / G] rows need no copy.
        torch.bmm(x.transpose(0, 1), weight.transpose(1, 2), out=out.transpose(0, 1))
        return out


class PackedLinear(nn.Module, ABC):
    """A bias-free linear over stored bytes; subclasses register the buffers and view them."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features

    @abstractmethod
    def packed(self, start: int = 0, stop: int | None = None) -> QuantWeight:
        """Output rows ``[start, stop)`` as a ``QuantWeight`` (views, no copy)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = quant_matmul(x.reshape(-1, self.in_features), self.packed())
        return y.view(*x.shape[:-1], self.out_features)

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        groups = x.shape[1]
        rows = self.out_features // groups
        parts = [quant_matmul(x[:, g], self.packed(g * rows, (g + 1) * rows)) for g in range(groups)]
        return torch.stack(parts, dim=1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Fp8Linear(PackedLinear):
    """E4M3 ``weight [out, in]`` with one E8M0 ``scale`` per ``block x block`` tile."""

    def __init__(self, in_features: int, out_features: int, block: int):
        super().__init__(in_features, out_features)
        self.block = block
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn))
        scale_shape = (_ceil(out_features, block), _ceil(in_features, block))
        self.register_buffer("scale", torch.empty(scale_shape, dtype=torch.float8_e8m0fnu))

    def packed(self, start: int = 0, stop: int | None = None) -> QuantWeight:
        stop = self.out_features if stop is None else stop
        if start % self.block:
            raise ValueError(f"rows from {start}: an FP8 row slice starts on a multiple of {self.block}")
        scale = self.scale[start // self.block : _ceil(stop, self.block)]
        return fp8_weight(self.weight[start:stop], scale, self.block)


class Mxfp4Linear(PackedLinear):
    """Two E2M1 codes per byte (``weight [out, in/2]`` int8) with one E8M0 ``scale`` per 32 inputs."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features)
        self.register_buffer("weight", torch.empty(out_features, in_features // 2, dtype=torch.int8))
        scale_shape = (out_features, _ceil(in_features, MXFP4_GROUP))
        self.register_buffer("scale", torch.empty(scale_shape, dtype=torch.float8_e8m0fnu))

    def packed(self, start: int = 0, stop: int | None = None) -> QuantWeight:
        return mxfp4_weight(self.weight[start:stop], self.scale[start:stop])


class Int8Linear(PackedLinear):
    """W8A8: int8 ``weight [out, in]``, fp32 per-channel ``weight_scale [out, 1]`` and msModelSlim's
    ``weight_offset [out, 1]`` (zeros: symmetric; kept so the checkpoint loads as it is)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features)
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.empty(out_features, 1))
        self.register_buffer("weight_offset", torch.empty(out_features, 1))

    def packed(self, start: int = 0, stop: int | None = None) -> QuantWeight:
        return int8_weight(self.weight[start:stop], self.weight_scale[start:stop])


# W4A8 ``scale_bias`` columns of w1, w2, w3 as msModelSlim writes them (w2: one per tensor-parallel slice).
BIAS_COLUMNS = (1, 16, 1)


def _expert_tensors(fmt: str, out: int, inp: int, block: int, bias_columns: int) -> dict[str, tuple]:
    """One routed expert's projection in ``fmt``: checkpoint suffix -> (shape, dtype)."""
    channel = ((out, 1), torch.float32)
    return {
        DENSE: {"weight": ((out, inp), torch.float32)},
        FP8: {
            "weight": ((out, inp), torch.float8_e4m3fn),
            "scale": ((_ceil(out, block), _ceil(inp, block)), torch.float8_e8m0fnu),
        },
        MXFP4: {
            "weight": ((out, inp // 2), torch.int8),
            "scale": ((out, _ceil(inp, MXFP4_GROUP)), torch.float8_e8m0fnu),
        },
        INT8: {"weight": ((out, inp), torch.int8), "weight_scale": channel, "weight_offset": channel},
        INT4: {
            "weight": ((out // 2, inp), torch.int8),
            "weight_scale": channel,
            "weight_offset": channel,
            "scale_bias": ((out, bias_columns), torch.float32),
        },
    }[fmt]


class StackedRows(nn.Module):
    """Linears of one input and one format run as one GEMM over their output rows stacked: every tensor
    of each linear becomes a view of its rows in the stacked one, so what is loaded into the linears
    fills it. It holds no tensor of its own in the state dict (the linears hold them)."""

    def __init__(self, joint: nn.Module, widths: tuple[int, ...]):
        super().__init__()
        self.joint, self.widths = joint, widths

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each linear's output, a column range of the one GEMM's (a view)."""
        return self.joint(x).split(self.widths, dim=-1)

    def state_dict(self, *args: object, destination: dict | None = None, **kwargs: object) -> dict:
        """Nothing: the linears' tensors (views of the stacked ones) are the checkpoint's."""
        return {} if destination is None else destination


def stack_rows(*linears: nn.Module) -> StackedRows | None:
    """The linears as one ``StackedRows``, their tensors made views of its; None where they cannot
    stack: other classes, inputs or dtypes, or FP8 blocks of scales that a linear's rows would split."""
    first = linears[0]
    widths = tuple(linear.out_features for linear in linears)
    if any(type(m) is not type(first) or m.in_features != first.in_features for m in linears):
        return None
    joint = _joint_like(first, widths)
    if joint is None:
        return None
    joint = joint.to_empty(device=first.weight.device)
    tensors = {k: t for k, t in {**joint._parameters, **joint._buffers}.items() if t is not None}
    for name, whole in tensors.items():
        parts = [getattr(m, name) for m in linears]
        if sum(t.shape[0] for t in parts) != whole.shape[0] or any(
            t.shape[1:] != whole.shape[1:] or t.dtype != whole.dtype for t in parts
        ):
            return None
    for name, whole in tensors.items():
        start = 0
        for m in linears:
            rows = getattr(m, name).shape[0]
            view = whole.data[start : start + rows]
            view.copy_(getattr(m, name).data)  # what the linear holds already, if anything
            if name in m._parameters:
                m._parameters[name] = nn.Parameter(view, requires_grad=False)
            else:
                m._buffers[name] = view
            start += rows
    return StackedRows(joint, widths)


def _joint_like(m: nn.Module, widths: tuple[int, ...]) -> nn.Module | None:
    """An empty linear of ``m``'s class and input for the rows ``widths``, on ``meta``."""
    out = sum(widths)
    with torch.device("meta"):
        if isinstance(m, Fp8Linear):  # a linear's rows must start on a block of scales
            return (
                Fp8Linear(m.in_features, out, m.block) if all(w % m.block == 0 for w in widths[:-1]) else None
            )
        if type(m) in (Mxfp4Linear, Int8Linear):
            return type(m)(m.in_features, out)
        return DenseLinear(m.in_features, out).to(m.weight.dtype) if type(m) is DenseLinear else None


class StackedExperts(nn.Module):
    """A MoE layer's routed experts in any stored format (dense, FP8, MXFP4, int8 W8A8, int4 W4A8), each
    projection stacked over the experts (``w1`` / ``w3`` ``[E, I, ...]``, ``w2`` ``[E, D, ...]``, with their
    scales as ``{proj}_{suffix}``) for ``moe_gemm``: tokens sorted by expert on the device, no host read.
    Dense stacks are parameters (the loader sets their dtype), the others buffers. The state dict names
    them per expert, as the checkpoint does (``{e}.w1.weight``, ``{e}.w1.scale``, ...).

    ``bias_columns``: the columns of W4A8's ``scale_bias`` per projection, as the checkpoint has them."""

    PROJECTIONS = ("w1", "w2", "w3")

    def __init__(self, experts: int, hidden: int, inter: int, limit: float | None, fmt: str = DENSE,
                 block: int = 1, bias_columns: tuple[int, ...] = BIAS_COLUMNS):  # fmt: skip
        super().__init__()
        self.dims, self.limit, self.format, self.block = (experts, hidden, inter), limit, fmt, block
        shapes = ((inter, hidden), (hidden, inter), (inter, hidden))
        for name, (out, inp), columns in zip(self.PROJECTIONS, shapes, bias_columns, strict=True):
            for suffix, (shape, dtype) in _expert_tensors(fmt, out, inp, block, columns).items():
                t = torch.empty(experts, *shape, dtype=dtype)
                if fmt == DENSE:
                    self.register_parameter(name, nn.Parameter(t))
                else:
                    self.register_buffer(self._attribute(name, suffix), t)

    def pack(self, fmt: str, block: int = 1, bias_columns: tuple[int, ...] = BIAS_COLUMNS) -> StackedExperts:
        """The same experts held in the stored format ``fmt`` (the loader swaps it in on ``meta``)."""
        return StackedExperts(*self.dims, self.limit, fmt, block, bias_columns)

    @staticmethod
    def _attribute(projection: str, suffix: str) -> str:
        return projection if suffix == "weight" else f"{projection}_{suffix}"

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        for name in self.PROJECTIONS:
            for suffix in _expert_tensors(self.format, 2, 2, 1, 1):
                stack = getattr(self, self._attribute(name, suffix))
                stack = stack if keep_vars else stack.detach()
                for e in range(stack.shape[0]):
                    destination[f"{prefix}{e}.{name}.{suffix}"] = stack[e]

    def _weight(self, name: str) -> QuantWeight:
        data = getattr(self, name)
        if self.format == DENSE:
            return dense_weight(data)
        if self.format == FP8:
            return fp8_weight(data, getattr(self, f"{name}_scale"), self.block)
        if self.format == MXFP4:
            return mxfp4_weight(data, getattr(self, f"{name}_scale"))
        factory = int8_weight if self.format == INT8 else int4_weight
        return factory(data, getattr(self, f"{name}_weight_scale"))  # offsets are zero (checked at load)

    def routed(self) -> RoutedExperts:
        return RoutedExperts(self._weight("w1"), self._weight("w3"), self._weight("w2"), self.limit)

    def forward(
        self, x: torch.Tensor, picked: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``sum_j weights[t, j] * expert_{picked[t, j]}(x[t])`` in fp32, rounded to x's dtype first, plus
        the shared expert's output ``shared`` where given (``moe_gemm``'s combine adds it)."""
        return moe_gemm(x, picked, weights.float(), self.routed(), shared).float()

    def extra_repr(self) -> str:
        return f"format={self.format}, experts={self.w1.shape[0]}"
