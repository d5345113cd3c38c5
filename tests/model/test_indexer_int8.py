"""The V4 indexer over int8 index keys (a quantised cache, model-spec §9.4) against its float path, on the
tiny model: the same inputs scored over the float keys and over the keys as a quantised cache stores them."""

from __future__ import annotations

import copy
import dataclasses

import torch

from model.attention import Indexer
from model.cache import PoolRows
from model.checkpoint import load_model
from model.testing.tiny import write_tiny
from triton_kernels.kv_store import QuantizedRows, store_quantized


def _int8_keys(batch, layer: int):
    """``batch`` with the layer's index keys int8 with their scales, as a quantised cache holds them."""
    keys = batch.pools.index_keys[layer].data
    codes = torch.zeros(keys.shape, dtype=torch.int8)
    scale = torch.zeros(keys.shape[0])
    store_quantized(keys, torch.arange(keys.shape[0]), QuantizedRows(codes, scale))
    pools = copy.copy(batch.pools)
    pools.index_keys = {**pools.index_keys, layer: PoolRows(codes, scale)}
    return dataclasses.replace(batch, pools=pools)


def test_int8_indexer_keeps_the_float_selection(tmp_path) -> None:
    model = load_model(write_tiny(tmp_path / "tiny-v4"))
    calls = []
    indexers = [m for m in model.modules() if isinstance(m, Indexer)]
    handles = [m.register_forward_hook(lambda m, args, out: calls.append((m, args, out))) for m in indexers]
    ids = torch.randint(3, model.cfg.vocab_size, (300,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    assert calls
    kept = total = 0
    for module, (x, q_r, batch, inv_freq), picked in calls:
        with torch.no_grad():
            scores = module.scores(x, q_r, batch, inv_freq)
            batch8 = _int8_keys(batch, module.plan.index)
            scores8, picked8 = module.scores(x, q_r, batch8, inv_freq), module(x, q_r, batch8, inv_freq)
        finite = torch.isfinite(scores)
        assert torch.equal(finite, torch.isfinite(scores8))
        scale = scores[finite].abs().max()
        assert (scores8 - scores)[finite].abs().max() <= 0.05 * scale
        for a, b in zip(picked.tolist(), picked8.tolist(), strict=True):
            kept += len({p for p in a if p >= 0} & {p for p in b if p >= 0})
            total += sum(p >= 0 for p in a)
    print(f"tiny V4: int8 indexer keeps {kept / total:.4f} of the float picks")
    assert kept / total >= 0.9
