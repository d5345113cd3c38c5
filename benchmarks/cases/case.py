"""One operator call at one model-derived shape, as the benchmarks time it and the sweeps tune it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.workload import Phase
from model.config import ModelConfig


@dataclass(frozen=True)
class Case:
    """``ref`` and ``kernel`` run the torch reference and the Triton path on the same inputs.

    ``bytes`` is the compulsory HBM traffic (every input read and every output written once),
    ``flops`` the arithmetic of the contract (multiply-adds count two), on the int8 units when
    ``int8``. Together they place the case on the roofline.
    """

    op: str
    name: str
    phase: Phase
    ref: Callable[[], object]
    kernel: Callable[[], object]
    bytes: int
    flops: int = 0
    int8: bool = False


Builder = Callable[[ModelConfig, Phase, torch.device, torch.dtype], list[Case]]


def elements_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
