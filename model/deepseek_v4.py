"""DeepSeek V4: embedding, blocks with classic mHC, ``hc_head``, head (model-spec §3.1); an MTP layer
(§8.1) or, in the 0731 / 0813 releases, DSpark stages (§8.2) as the draft head.

Module attribute names are the official checkpoint names, so ``state_dict()`` keys are exactly
the tensors a checkpoint holds (``layers.N.attn.wq_a.weight``, ``mtp.0.e_proj.weight``...).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from model.attention import V4Attention
from model.block import HcHead, MhcBlock
from model.cache import Batch, SeqCache, SequenceState
from model.config import ModelConfig
from model.dspark import DSpark
from model.layers import RMSNorm, RopeFrequencies, check_token_ids, linear
from model.plan import LayerPlan, build_plan
from triton_kernels.custom_ops import hc_update


class Block(MhcBlock):
    """A V4 block: classic mHC, each sublayer collapses the streams with its own pre-mix."""

    def __init__(self, cfg: ModelConfig, plan: LayerPlan):
        super().__init__(cfg, plan, V4Attention(cfg, plan))

    def forward(
        self, x: torch.Tensor, ids: torch.Tensor, batch: Batch, inv_freq: torch.Tensor
    ) -> torch.Tensor:
        """``x [T, n, D]`` streams in and out."""
        _, post, comb, h = self.mix(x, "attn")
        a = self.attn(h, batch, inv_freq)
        x = hc_update(x, a, post, comb)
        _, post, comb, h = self.mix(x, "ffn")
        f = self.ffn(h, ids)
        return hc_update(x, f, post, comb)


class MtpLayer(Block):
    """The V4 MTP draft block (model-spec §8.1): a sliding-only block with input projections and ``hc_head``.

    At position t it combines the backbone streams ``H_t`` with the embedding of token t+1 and
    predicts token t+2; its rope and window use position t. Speculative decoding drives it.
    """

    def __init__(self, cfg: ModelConfig, plan: LayerPlan):
        super().__init__(cfg, plan)
        self.e_proj, self.h_proj = (
            linear(cfg.hidden_size, cfg.hidden_size),
            linear(cfg.hidden_size, cfg.hidden_size),
        )
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HcHead(cfg)

    def predict(
        self,
        streams: torch.Tensor,
        next_ids: torch.Tensor,
        batch: Batch,
        inv_freq: torch.Tensor,
        embed: nn.Embedding,
        head: nn.Linear,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[S, V]`` for the tokens after ``next_ids``, and the output streams (to chain drafts)."""
        e = self.e_proj(self.enorm(embed(next_ids)))
        x = self.h_proj(self.hnorm(streams)) + e[:, None, :]
        x = self.forward(x, next_ids, batch, inv_freq)
        return head(self.hc_head.collapse(x, self.norm)).float(), x


class DeepseekV4(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.plan = build_plan(cfg)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        backbone = [p for p in self.plan if not p.is_draft]
        self.layers = nn.ModuleList(Block(cfg, p) for p in backbone)
        drafts = [p for p in self.plan if p.is_draft]
        self.mtp = DSpark(cfg, drafts) if cfg.is_dspark else nn.ModuleList(MtpLayer(cfg, p) for p in drafts)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = linear(cfg.hidden_size, cfg.vocab_size)
        self.hc_head = HcHead(cfg)
        self.rope = RopeFrequencies(cfg)

    def init_buffers(self) -> None:
        """Fill what the checkpoint does not hold, once a model built on ``meta`` is materialised."""
        self.rope.fill()

    def checkpoint_names(self) -> dict[str, tuple[int, ...]]:
        """Official tensor names and their shapes, as this model loads them."""
        return {name: tuple(t.shape) for name, t in self.official_state().items()}

    def official_state(self) -> dict[str, torch.Tensor]:
        """The checkpointed tensors by official name, sharing their storage (the loader fills them)."""
        return {_official(name): t for name, t in self.state_dict().items()}

    def new_state(self, kv_cache_dtype: str = "auto") -> SequenceState:
        """A request served by the model alone (its KV in a private store, as ``kv_cache_dtype``)."""
        return SequenceState.new(self.cfg, self.embed.weight.dtype, self.embed.weight.device, kv_cache_dtype)

    def hidden_streams(self, ids: torch.Tensor, state: SequenceState | None = None) -> torch.Tensor:
        """Backbone streams before ``hc_head`` (the MTP input): ``[S, n, D]``.

        Without a state ``ids`` is a whole sequence from position 0 (cache-free path); with one,
        ``ids`` continues the request and the state advances.
        """
        check_token_ids(ids, self.cfg.vocab_size)
        state = state or self.new_state()
        return self.batch_streams(ids, state.batch(ids.shape[0], ids.device))

    def batch_streams(
        self, ids: torch.Tensor, batch: Batch, features: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Streams of the flat tokens of several requests (``batch`` says whose and where their KV is);
        ``features`` collects DSpark's input, the mean of the streams entering each target layer."""
        x = self.embed(ids)[:, None, :].expand(-1, self.cfg.hc_mult, -1).contiguous()
        for i, layer in enumerate(self.layers):
            if features is not None and self.cfg.is_dspark_target(i):
                features.append(x.float().mean(dim=1))
            x = layer(x, ids, batch, self.rope(layer.plan.rope))
        batch.advance()
        return x

    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        return self.head(self.hc_head.collapse(streams, self.norm)).float()

    def batch_forward(
        self, ids: torch.Tensor, batch: Batch, rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The engine's step over a flat multi-request batch: logits ``[len(rows), V]`` at token ``rows``
        and what the draft head reads for every token: the backbone streams ``[T, n, D]`` (MTP) or the
        target features ``[T, n_targets, D]`` (DSpark)."""
        features = [] if self.cfg.is_dspark else None
        streams = self.batch_streams(ids, batch, features)
        draft_input = streams if features is None else torch.stack(features, dim=1)
        return self.logits(streams[rows]), draft_input

    def rollback(self, seq: SeqCache, kept: torch.Tensor) -> None:
        """Keep only the tokens ``kept`` of the request's call since ``seq.speculate()``."""
        seq.rollback(kept.numel())

    def forward(
        self, ids: torch.Tensor, state: SequenceState | None = None, last_only: bool = False
    ) -> torch.Tensor:
        """Logits ``[S, V]`` (fp32) for token ids ``[S]``; ``[1, V]`` of the last one with ``last_only``."""
        streams = self.hidden_streams(ids, state)
        return self.logits(streams[-1:] if last_only else streams)


# The official names put the ``hc_head_*`` tensors directly on the model (and on ``mtp.0``).
def _official(name: str) -> str:
    return re.sub(r"(^|\.)hc_head\.", r"\1", name)
