"""Linear layers whose weights stay in the checkpoint's stored format (model-spec §9.1, §9.5).

Every linear of the model is built as a ``DenseLinear``; the loader swaps one for a ``PackedLinear``
(``Fp8Linear``, ``Mxfp4Linear``, ``Int8Linear``) while the model is still on ``meta`` when the
checkpoint stores it quantised, so the stored bytes and scales are the module's buffers, under the
checkpoint's own names (``X.weight`` / ``X.scale``, msModelSlim's ``X.weight_scale`` /
``X.weight_offset``). The forward is ``triton_kernels.quant_matmul``: the Triton kernel on a device,
its torch reference on the CPU, which decodes one tile of rows at a time (the weight stays packed).
``PackedExperts`` does the same for a MoE layer's MXFP4 routed experts, stacked for ``moe_gemm``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from triton_kernels.moe_gemm import RoutedExperts, moe_gemm
from triton_kernels.quant_matmul import (
    MXFP4_GROUP,
    QuantWeight,
    fp8_weight,
    int8_weight,
    mxfp4_weight,
    quant_matmul,
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
        return torch.bmm(x.transpose(0, 1), weight.transpose(1, 2)).transpose(0, 1)  # one batched GEMM


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


class PackedExperts(nn.Module):
    """A MoE layer's routed experts in MXFP4, stacked (``w1`` / ``w3`` ``[E, I, D/2]``, ``w2``
    ``[E, D, I/2]`` with their ``*_scale``) for ``moe_gemm``: tokens sorted by expert on the device,
    no host read. The state dict names them per expert, as the checkpoint does."""

    PROJECTIONS = ("w1", "w2", "w3")

    def __init__(self, experts: int, hidden: int, inter: int, limit: float | None):
        super().__init__()
        self.limit = limit
        for name, (out, inp) in zip(
            self.PROJECTIONS, ((inter, hidden), (hidden, inter), (inter, hidden)), strict=True
        ):
            self.register_buffer(name, torch.empty(experts, out, inp // 2, dtype=torch.int8))
            scale = torch.empty(experts, out, _ceil(inp, MXFP4_GROUP), dtype=torch.float8_e8m0fnu)
            self.register_buffer(f"{name}_scale", scale)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        for name in self.PROJECTIONS:
            stack, scale = getattr(self, name), getattr(self, f"{name}_scale")
            for e in range(stack.shape[0]):
                destination[f"{prefix}{e}.{name}.weight"] = stack[e]
                destination[f"{prefix}{e}.{name}.scale"] = scale[e]

    def routed(self) -> RoutedExperts:
        w1, w2, w3 = (mxfp4_weight(getattr(self, n), getattr(self, f"{n}_scale")) for n in self.PROJECTIONS)
        return RoutedExperts(w1, w3, w2, self.limit)

    def forward(self, x: torch.Tensor, picked: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``sum_j weights[t, j] * expert_{picked[t, j]}(x[t])`` in fp32."""
        return moe_gemm(x, picked, weights.float(), self.routed()).float()
