"""DSpark draft head (model-spec §8.2): a block of drafted tokens per pass, for both families.

Stages ``mtp.0..`` are sliding-only blocks. In V4.1 they form their own single-pass mHC chain, have
no per-head q norm, route over their own experts and collapse with the last FFN pre-mix; in the V4
family (V4-Flash-0731, V4-Pro-0813) they are classic V4 blocks (per-head q norm, the backbone's
experts) and the last stage collapses with a learned ``hc_head``. The Markov head's tensors are
``markov_w1/markov_w2`` in V4 and ``embed/head`` in V4.1. Context
comes from the backbone: for every committed position p, ``main_x_p = main_norm(main_proj ·
concat_l mean_k X^(l)_p)`` over the target layers, turned by each stage into a context key
(``wkv -> kv_norm -> RoPE(p)``) kept for the last W positions. A draft block ``[a, ν, ..., ν]`` at
positions ``c+1 .. c+B`` attends, non-causally, to all B block tokens and the stage's context
keys; a Markov head then proposes the tokens one by one, each with a confidence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from model.attention import SharedKVAttention
from model.block import HcHead, MhcBlock, one_hot_premix
from model.config import ModelConfig
from model.layers import RMSNorm, linear
from model.plan import LayerPlan
from triton_kernels.custom_ops import hc_collapse, hc_update
from triton_kernels.sparse_attn import KVPool


@dataclass
class DSparkState:
    """Context keys of each stage for the latest committed positions (at most W, oldest first)."""

    keys: list[torch.Tensor]  # per stage [<= W, d]
    num_tokens: int = 0  # committed positions whose keys were added


@dataclass
class Draft:
    tokens: list[int]
    logits: torch.Tensor  # [B, V] fp32: the distribution each token was drawn from (before sampling)
    confidence: torch.Tensor  # [B] in (0, 1)


class MarkovHead(nn.Module):
    """Two ``[V, R]`` tables: an embedding of the previous token and a rank-to-vocabulary linear."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.names = ("embed", "head") if cfg.is_v41 else ("markov_w1", "markov_w2")
        for name in self.names:
            setattr(self, name, linear(cfg.dspark.markov_rank, cfg.vocab_size))

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The embedding and output tables, fp32."""
        return tuple(getattr(self, name).weight.float() for name in self.names)


class DSparkStage(MhcBlock):
    def __init__(self, cfg: ModelConfig, plan: LayerPlan, first: bool, last: bool):
        super().__init__(cfg, plan, SharedKVAttention(cfg, plan, head_norm=not cfg.is_v41))
        self.single_pass = cfg.is_v41
        if first:
            self.main_proj = linear(len(cfg.dspark.target_layer_ids) * cfg.hidden_size, cfg.hidden_size)
            self.main_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.markov_head = MarkovHead(cfg)
            self.confidence_head = nn.Module()
            self.confidence_head.proj = linear(cfg.hidden_size + cfg.dspark.markov_rank, 1)
            if not self.single_pass:
                self.hc_head = HcHead(cfg)

    def context_keys(
        self, main_x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
    ) -> torch.Tensor:
        return self.attn.kv_norm.rotated(self.attn.wkv(main_x), positions, inv_freq)

    def forward(
        self,
        x: torch.Tensor,
        carry: torch.Tensor,
        ids: torch.Tensor,
        context: torch.Tensor,
        index: torch.Tensor,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One block over the draft streams ``x [T, n, D]`` of one or more blocks: token t reads the
        rows ``index[t]`` (-1: none) of ``cat(context, the block tokens' keys)``. Single-pass mHC
        collapses each sublayer's input with the pre-mix before it (``carry`` in, the FFN's out);
        classic mHC with the sublayer's own."""
        attn_pre, post, comb, h = self.mix(x, "attn", carry if self.single_pass else None)
        attn = self.attn
        _, q, kv = attn.project(h, positions, inv_freq)
        pool = KVPool(torch.cat([context, kv]), index)
        x = hc_update(x, attn.output(q, [pool], positions, inv_freq), post, comb)
        ffn_pre, post, comb, h = self.mix(x, "ffn", attn_pre if self.single_pass else None)
        f = self.ffn(h, ids)
        return hc_update(x, f, post, comb), ffn_pre

    def collapse(self, x: torch.Tensor, carry: torch.Tensor) -> torch.Tensor:
        """The last stage's pre-norm hidden: the last FFN pre-mix (V4.1) or the learned ``hc_head`` (V4)."""
        return hc_collapse(x, carry) if self.single_pass else self.hc_head.collapse(x)


class DSpark(nn.ModuleList):
    """The stages, mounted as ``mtp`` (``mtp.0``, ``mtp.1``...); shares the model's ``embed`` and ``head``."""

    def __init__(self, cfg: ModelConfig, plans: list[LayerPlan]):
        last = len(plans) - 1
        super().__init__(DSparkStage(cfg, p, i == 0, i == last) for i, p in enumerate(plans))
        self.cfg = cfg

    def new_state(self, device: torch.device) -> DSparkState:
        return DSparkState([torch.zeros(0, self.cfg.head_dim, device=device) for _ in self])

    def add_context(self, features: torch.Tensor, state: DSparkState, inv_freq: torch.Tensor) -> None:
        """Add the context keys of the next committed positions, from backbone ``features [S, n_T, D]``."""
        first = self[0]
        main_x = first.main_norm(first.main_proj(features.flatten(1).to(first.main_proj.weight.dtype)))
        positions = torch.arange(
            state.num_tokens, state.num_tokens + features.shape[0], device=features.device
        )
        window = self.cfg.sliding_window
        for i, stage in enumerate(self):
            keys = torch.cat([state.keys[i], stage.context_keys(main_x, positions, inv_freq)])
            state.keys[i] = keys[max(0, keys.shape[0] - window) :]
        state.num_tokens += features.shape[0]

    @torch.no_grad()
    def propose(
        self,
        anchors: list[int],
        states: list[DSparkState],
        embed: nn.Embedding,
        head: nn.Linear,
        inv_freq: torch.Tensor,
        sample: Callable[[int, torch.Tensor], int] = lambda i, logits: int(logits.argmax()),
    ) -> list[Draft]:
        """Draft ``dspark_block_size`` tokens after each request's anchor (its token at position
        ``num_tokens``), every request in one pass per stage; ``sample(i, logits)`` picks request i's."""
        cfg, device = self.cfg, embed.weight.device
        block, n = cfg.dspark.block_size, len(anchors)
        ids = torch.full((n, block), cfg.dspark.noise_token_id, device=device)
        ids[:, 0] = torch.tensor(anchors, device=device)
        ids = ids.flatten()
        offsets = torch.arange(block, device=device)
        positions = (torch.tensor([s.num_tokens for s in states], device=device)[:, None] + offsets).flatten()
        x = embed(ids)[:, None, :].expand(-1, cfg.hc_mult, -1).contiguous()
        carry = one_hot_premix(n * block, cfg.hc_mult, device)
        index = _block_index([s.keys[0].shape[0] for s in states], block, device)
        for i, stage in enumerate(self):
            context = torch.cat([s.keys[i] for s in states])
            x, carry = stage(x, carry, ids, context, index, positions, inv_freq)
        last = self[-1]
        hidden = last.collapse(x, carry).float().view(n, block, -1)
        base = head(last.norm(hidden).to(head.weight.dtype)).float()  # U_k
        markov_embed, markov_out = last.markov_head.tables()
        proj = last.confidence_head.proj.weight.float()
        prev, tokens, logits, confidence = torch.tensor(anchors, device=device), [], [], []
        for k in range(block):
            mu = markov_embed[prev]  # [n, R]
            step = base[:, k] + mu @ markov_out.T
            confidence.append(torch.sigmoid(torch.cat([hidden[:, k], mu], dim=1) @ proj.T)[:, 0])
            prev = torch.tensor([sample(i, row) for i, row in enumerate(step)], device=device)
            tokens.append(prev)
            logits.append(step)
        tokens, logits, confidence = (torch.stack(t, dim=1) for t in (tokens, logits, confidence))
        return [Draft(tokens[i].tolist(), logits[i], confidence[i]) for i in range(n)]


def _block_index(context_lengths: list[int], block: int, device: torch.device) -> torch.Tensor:
    """Rows each draft token reads of ``cat(contexts, block keys)``: its request's context keys (the
    contexts laid end to end), then all ``block`` keys of its own block; -1 pads."""
    lengths = torch.tensor(context_lengths, device=device)
    starts = lengths.cumsum(0) - lengths
    width = max(context_lengths, default=0)
    columns = torch.arange(width, device=device)
    context = torch.where(columns < lengths[:, None], starts[:, None] + columns, -1)
    own = int(lengths.sum()) + torch.arange(len(context_lengths), device=device)[:, None] * block
    own = own + torch.arange(block, device=device)
    return torch.cat([context, own], dim=1).repeat_interleave(block, dim=0)
