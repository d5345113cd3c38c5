"""The sublayer pair every V4 / V4.1 block has, with its mHC parameters; the V4 learned final collapse."""

from __future__ import annotations

import torch
from torch import nn

from model.config import ModelConfig
from model.layers import RMSNorm
from model.moe import MoE
from model.plan import LayerPlan
from triton_kernels.custom_ops import hc_collapse, hc_head_coeffs, hc_mix


class MhcBlock(nn.Module):
    """Attention and MoE sublayers with their norms and mHC parameters (``hc_attn_*``, ``hc_ffn_*``)."""

    def __init__(self, cfg: ModelConfig, plan: LayerPlan, attn: nn.Module):
        super().__init__()
        self.cfg, self.plan = cfg, plan
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = attn
        self.ffn = MoE(cfg, plan)
        width, streams = cfg.mix_width, cfg.hc_mult * cfg.hidden_size
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", nn.Parameter(torch.empty(width, streams)))
            setattr(self, f"hc_{site}_base", nn.Parameter(torch.empty(width)))
            setattr(self, f"hc_{site}_scale", nn.Parameter(torch.empty(3)))

    def mix(
        self, x: torch.Tensor, site: str, carry: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """pre ``[S, n]``, post ``[S, n]`` and comb ``[S, n, n]`` of the streams ``x`` for ``site``, and the
        sublayer's input ``[S, D]``: the streams collapsed by ``carry`` (or by pre) and normed by the site's
        norm, in one op."""
        norm: RMSNorm = getattr(self, f"{site}_norm")
        return hc_mix(
            x,
            getattr(self, f"hc_{site}_fn"),
            getattr(self, f"hc_{site}_base"),
            getattr(self, f"hc_{site}_scale"),
            norm_eps=self.cfg.rms_norm_eps,
            hc_eps=self.cfg.hc_eps,
            sinkhorn_iters=self.cfg.hc_sinkhorn_iters,
            input_weight=norm.weight,
            input_eps=norm.eps,
            carry=carry,
        )


def one_hot_premix(tokens: int, streams: int, device: torch.device) -> torch.Tensor:
    """The pre-mix entering a V4.1 single-pass chain: all weight on stream 0."""
    carry = torch.zeros(tokens, streams, device=device)
    carry[:, 0] = 1.0
    return carry


class HcHead(nn.Module):
    """Learned final collapse of the streams (no Sinkhorn)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.hc_head_fn = nn.Parameter(torch.empty(cfg.hc_mult, cfg.hc_mult * cfg.hidden_size))
        self.hc_head_base = nn.Parameter(torch.empty(cfg.hc_mult))
        self.hc_head_scale = nn.Parameter(torch.empty(1))

    def collapse(self, x: torch.Tensor, norm: RMSNorm | None = None) -> torch.Tensor:
        """The streams' learned collapse; ``norm`` applied to it in the same op."""
        pre = hc_head_coeffs(
            x,
            self.hc_head_fn,
            self.hc_head_base,
            self.hc_head_scale,
            norm_eps=self.cfg.rms_norm_eps,
            hc_eps=self.cfg.hc_eps,
        )
        return hc_collapse(x, pre) if norm is None else norm.collapsed(x, pre)
