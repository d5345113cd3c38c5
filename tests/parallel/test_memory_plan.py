"""The start-up memory plan over several ranks counts one rank's weights: what that rank's sliced load
then holds, a share of the whole model's."""

from __future__ import annotations

import pytest
import torch

from engine.memory_plan import plan_memory
from engine.parallel.plans import resident_bytes
from model.checkpoint import load_model
from model.parallel.context import ParallelContext
from model.testing.tiny import cached_tiny

SHAPE = {"max_num_batched_tokens": 64, "max_model_len": 256, "block_size": 16, "kv_cache_memory": 2**24}


@pytest.mark.parametrize("data_parallel", [False, True])
def test_the_plan_counts_the_weights_one_rank_loads(data_parallel: bool):
    path = cached_tiny("v4")
    whole = plan_memory(path, torch.float32, "auto", **SHAPE).weight_bytes
    for rank in range(2):
        context = ParallelContext(rank, 2, data_parallel=data_parallel)
        plan = plan_memory(path, torch.float32, "auto", parallel=context, **SHAPE)
        loaded = load_model(path, parallel=context).official_state().values()
        assert plan.weight_bytes == resident_bytes(loaded) < whole
