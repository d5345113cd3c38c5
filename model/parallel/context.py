"""This process's place in a tensor- or data-parallel group, and the collectives the model runs on it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


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
