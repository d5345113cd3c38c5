"""The MoE gate (model-spec §7): weights from the unbiased sqrtsoftplus scores of the experts the biased
scores pick, normalised when more than one is picked, then scaled."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model.config import ModelConfig
from model.moe import Gate
from model.plan import build_plan
from model.testing.tiny import toy_config


@pytest.mark.parametrize("top_k", [1, 2])
def test_weights_are_normalised_from_two_experts_on(top_k: int) -> None:
    cfg = ModelConfig.from_dict(
        {**toy_config("v4"), "num_experts_per_tok": top_k, "routed_scaling_factor": 1.5}
    )
    plan = next(p for p in build_plan(cfg) if not p.hash_moe)
    gate = Gate(cfg, plan, plan.n_experts, plan.top_k)
    torch.nn.init.normal_(gate.weight, generator=torch.Generator().manual_seed(0))
    torch.nn.init.normal_(gate.bias, generator=torch.Generator().manual_seed(1))
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    picked, weights = gate(x, torch.zeros(5, dtype=torch.int64))
    scores = torch.sqrt(F.softplus(x @ gate.weight.T))
    assert torch.equal(picked, (scores + gate.bias).topk(top_k).indices)
    raw = scores.gather(1, picked)
    want = raw * 1.5 if top_k == 1 else raw / (raw.sum(-1, keepdim=True) + 1e-20) * 1.5
    torch.testing.assert_close(weights, want, rtol=1e-6, atol=0)
