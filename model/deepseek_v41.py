"""DeepSeek V4.1: Engram, CSA2 layers sharing compressed KV, single-pass mHC (model-spec §3.2, §5.4).

Each sublayer collapses the streams with the pre-mix of the sublayer before it: attention of
layer l with the FFN pre-mix of layer l-1 (one-hot on stream 0 before layer 0), the FFN with
its own layer's attention pre-mix; the final collapse uses the last FFN pre-mix (no ``hc_head``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from model.attention_v41 import Published, V41Attention
from model.block import MhcBlock, one_hot_premix
from model.cache import Batch, SeqCache, SequenceState
from model.config import ModelConfig
from model.dspark import DSpark
from model.engram import Engram, EngramHasher
from model.layers import RMSNorm, RopeFrequencies, check_token_ids, linear
from model.plan import LayerPlan, build_plan
from triton_kernels.custom_ops import hc_collapse, hc_update


@dataclass
class Forward41:
    """What one call produces: the collapsed pre-norm hidden ``[S, D]`` and DSpark's features."""

    hidden: torch.Tensor
    target_features: torch.Tensor  # [S, n_targets, D]: mean over streams entering each target layer


class Block41(MhcBlock):
    def __init__(self, cfg: ModelConfig, plan: LayerPlan):
        super().__init__(cfg, plan, V41Attention(cfg, plan))
        if plan.engram:
            self.engram = Engram(cfg.engram, plan.index)

    def forward(
        self,
        x: torch.Tensor,
        carry: torch.Tensor,
        ids: torch.Tensor,
        batch: Batch,
        inv_freq: torch.Tensor,
        published: Published,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Streams ``x [S, n, D]`` and the carried pre-mix ``[S, n]`` in; both updated out."""
        attn_pre, post, comb, h = self.mix(x, "attn", carry)
        a = self.attn(h, batch, inv_freq, published)
        x = hc_update(x, a, post, comb)
        ffn_pre, post, comb, h = self.mix(x, "ffn", attn_pre)
        f = self.ffn(h, ids)
        return hc_update(x, f, post, comb), ffn_pre


class DeepseekV41(nn.Module):
    def __init__(self, cfg: ModelConfig, token_map: np.ndarray | None = None):
        """``token_map``: the tokenizer's Engram compressed-id map (needed with Engram layers)."""
        super().__init__()
        self.cfg = cfg
        self.plan = build_plan(cfg)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block41(cfg, p) for p in self.plan if not p.is_draft)
        drafts = [p for p in self.plan if p.is_draft]
        self.mtp = DSpark(cfg, drafts) if drafts else None
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = linear(cfg.hidden_size, cfg.vocab_size)
        self.token_map = token_map
        self.hasher: EngramHasher | None = None
        self.rope = RopeFrequencies(cfg)
        self.init_buffers()

    def init_buffers(self) -> None:
        """Rope tables and Engram hash tables (again once a model built on ``meta`` is materialised)."""
        self.rope.fill()
        if self.cfg.engram is None or self.rope.main.is_meta:
            return
        if self.token_map is None:
            raise ValueError("this V4.1 model has Engram layers: a tokenizer token map is required")
        self.hasher = EngramHasher.build(self.cfg.engram, self.token_map, self.rope.main.device)

    def checkpoint_names(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(t.shape) for name, t in self.official_state().items()}

    def official_state(self) -> dict[str, torch.Tensor]:
        """The checkpointed tensors (official names are the module names here), sharing their storage."""
        return self.state_dict()

    def new_state(self, kv_cache_dtype: str = "auto") -> SequenceState:
        """A request served by the model alone (its KV in a private store, as ``kv_cache_dtype``)."""
        return SequenceState.new(self.cfg, self.embed.weight.dtype, self.embed.weight.device, kv_cache_dtype)

    def run(self, ids: torch.Tensor, state: SequenceState | None = None) -> Forward41:
        """The backbone over ``ids [S]``: from position 0 without a state, continuing it with one."""
        check_token_ids(ids, self.cfg.vocab_size)
        state = state or self.new_state()
        return self.run_batch(ids, state.batch(ids.shape[0], ids.device))

    def run_batch(self, ids: torch.Tensor, batch: Batch) -> Forward41:
        """The backbone over the flat tokens of several requests (``batch``: whose, and where their KV is)."""
        cfg, device = self.cfg, ids.device
        buckets = self._engram_buckets(ids, batch)
        x = self.embed(ids)[:, None, :].expand(-1, cfg.hc_mult, -1).contiguous()
        carry = one_hot_premix(ids.shape[0], cfg.hc_mult, device)
        published, features = Published(), []
        for i, layer in enumerate(self.layers):
            if layer.plan.engram:
                x = layer.engram(x, buckets[:, cfg.engram.layer_ids.index(i)])
            if cfg.is_dspark_target(i):
                features.append(x.float().mean(dim=1))
            x, carry = layer(x, carry, ids, batch, self.rope(layer.plan.rope), published)
        batch.advance()
        hidden = hc_collapse(x, carry)
        if not features:
            return Forward41(hidden, hidden.new_zeros(ids.shape[0], 0, cfg.hidden_size))
        return Forward41(hidden, torch.stack(features, dim=1))

    def _engram_buckets(self, ids: torch.Tensor, batch: Batch) -> torch.Tensor | None:
        """Each request's n-gram bucket ids, hashed with its look-back history."""
        if self.hasher is None:
            return None
        if batch.engram_history is not None:  # a step of fixed shape: look-backs padded, rows of one tensor
            buckets, history = self.hasher.padded(ids, batch.engram_history)
            batch.after(_keep_look_backs, history)
            return buckets
        buckets, histories = self.hasher.batch(ids, batch.bounds, [s.engram_history for s in batch.seqs])
        for seq, history in zip(batch.seqs, histories, strict=True):
            seq.engram_history = history
        return buckets

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(hidden)).float()

    def batch_forward(
        self, ids: torch.Tensor, batch: Batch, rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The engine's step over a flat multi-request batch: logits ``[len(rows), V]`` at token ``rows``
        and what DSpark reads for every token, the target features ``[T, n_targets, D]``."""
        out = self.run_batch(ids, batch)
        return self.logits(out.hidden[rows]), out.target_features

    def rollback(self, seq: SeqCache, kept: torch.Tensor) -> None:
        """Keep only the tokens ``kept`` of the request's call since ``seq.speculate()``."""
        history = seq.rollback(kept.numel())
        if self.hasher is not None:
            seq.engram_history = self.hasher.advance(_history(history, kept.device), kept)

    def forward(
        self, ids: torch.Tensor, state: SequenceState | None = None, last_only: bool = False
    ) -> torch.Tensor:
        """Logits ``[S, V]`` (fp32) for token ids ``[S]``; ``[1, V]`` of the last one with ``last_only``."""
        hidden = self.run(ids, state).hidden
        return self.logits(hidden[-1:] if last_only else hidden)


def _keep_look_backs(batch: Batch, history: torch.Tensor) -> None:
    for seq, row in zip(batch.live_seqs, history, strict=False):
        seq.engram_history = row.clone()  # a graph reuses its outputs


def _history(history: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """A request's Engram look-back: none before its first token."""
    return torch.zeros(0, dtype=torch.int64, device=device) if history is None else history
