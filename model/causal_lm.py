"""What the loader, the engine, the runner and the proposers call on a model: ``DeepseekV4`` and
``DeepseekV41`` both satisfy it, so callers name this instead of the union of the two."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from model.cache import Batch, SeqCache, SequenceState
from model.config import ModelConfig
from model.layers import RopeFrequencies


class CausalLM(Protocol):
    cfg: ModelConfig
    embed: nn.Embedding
    head: nn.Module
    rope: RopeFrequencies
    mtp: nn.Module | None  # MTP layers or DSpark stages (V4.1 without drafts: None)

    def init_buffers(self) -> None:
        """Fill what the checkpoint does not hold, once a model built on ``meta`` is materialised."""

    def checkpoint_names(self) -> dict[str, tuple[int, ...]]:
        """Official tensor names and their shapes, as this model loads them."""

    def official_state(self) -> dict[str, torch.Tensor]:
        """The checkpointed tensors by official name, sharing their storage."""

    def new_state(self, kv_cache_dtype: str = "auto") -> SequenceState:
        """A request served by the model alone (its KV in a private store, as ``kv_cache_dtype``)."""

    def batch_forward(
        self, ids: torch.Tensor, batch: Batch, rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits at token ``rows`` of a flat multi-request batch, and what the draft head reads."""

    def rollback(self, seq: SeqCache, kept: torch.Tensor) -> None:
        """Keep only the tokens ``kept`` of the request's call since ``seq.speculate()``."""

    def __call__(
        self, ids: torch.Tensor, state: SequenceState | None = None, last_only: bool = False
    ) -> torch.Tensor:
        """Logits ``[S, V]`` (fp32) for token ids ``[S]``."""
