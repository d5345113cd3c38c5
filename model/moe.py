"""Mixture of experts with the sqrtsoftplus router, selection bias, hash routing and a shared expert.

Routing math is fp32. Score-routed layers select with the biased scores and weight with the
unbiased ones; hash layers (the first ``num_hash_layers``) take their experts from ``tid2eid``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig
from model.layers import linear
from model.plan import LayerPlan
from model.quant_linear import StackedExperts, StackedRows, stack_rows
from triton_kernels.custom_ops import route, swiglu


class Expert(nn.Module):
    """SwiGLU with a one-sided clamp on the gate and a two-sided clamp on the up projection."""

    def __init__(self, hidden: int, inter: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1, self.w2, self.w3 = linear(hidden, inter), linear(inter, hidden), linear(hidden, inter)
        self.gate_up: StackedRows | None = None

    def stack_projections(self) -> None:
        """``w1`` and ``w3`` as one GEMM (before the weights load: they load into its rows)."""
        self.gate_up = stack_rows(self.w1, self.w3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = (self.w1(x), self.w3(x)) if self.gate_up is None else self.gate_up(x)
        return self.w2(swiglu(gate, up, self.limit))


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: LayerPlan, experts: int, top_k: int):
        super().__init__()
        self.top_k, self.temp = top_k, cfg.gate_temp
        # One expert's weight normalised would be 1 whatever its score: the spec normalises from k = 2.
        self.scaling, self.normalize = cfg.routed_scaling_factor, cfg.norm_topk_prob and top_k > 1
        self.weight = nn.Parameter(torch.empty(experts, cfg.hidden_size))
        if plan.hash_moe:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, top_k, dtype=torch.int64))
        else:
            self.bias = nn.Parameter(torch.empty(experts))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert indices ``[S, k]`` and their weights ``[S, k]`` (fp32)."""
        logits = F.linear(x.float(), self.weight.float())
        hashed = self.tid2eid[ids] if hasattr(self, "tid2eid") else None
        bias = None if hashed is not None else self.bias.float()
        return route(logits, bias, hashed, self.top_k, self.temp, self.normalize, self.scaling)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: LayerPlan):
        super().__init__()
        experts = plan.n_experts
        self.gate = Gate(cfg, plan, experts, plan.top_k)
        inter, limit = cfg.moe_intermediate_size, cfg.swiglu_limit
        self.shape = (experts, cfg.hidden_size, inter, limit)
        self.experts = StackedExperts(*self.shape)
        self.shared_experts = Expert(cfg.hidden_size, inter, limit) if cfg.n_shared_experts else None

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        picked, weights = self.gate(x, ids)
        shared = None if self.shared_experts is None else self.shared_experts(x)
        return self.experts(x, picked, weights, shared).to(x.dtype)
