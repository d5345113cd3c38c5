"""The V4 indexer in the Ascend int8 format (model-spec §9.4) against its float path, on the tiny model."""

from __future__ import annotations

import torch

from model.attention import Indexer
from model.checkpoint import load_model
from model.testing.tiny import write_tiny


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
    for module, args, picked in calls:
        with torch.no_grad():
            scores = module.scores(*args)
            module.int8 = True
            scores8, picked8 = module.scores(*args), module(*args)
            module.int8 = False
        finite = torch.isfinite(scores)
        assert torch.equal(finite, torch.isfinite(scores8))
        scale = scores[finite].abs().max()
        assert (scores8 - scores)[finite].abs().max() <= 0.05 * scale
        for a, b in zip(picked.tolist(), picked8.tolist(), strict=True):
            kept += len({p for p in a if p >= 0} & {p for p in b if p >= 0})
            total += sum(p >= 0 for p in a)
    print(f"tiny V4: int8 indexer keeps {kept / total:.4f} of the float picks")
    assert kept / total >= 0.9
