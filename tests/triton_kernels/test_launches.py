"""tests/ascend/launches.json (the launches of the tiny models, lowered by the Ascend gate) still fits the
kernels: every entry names a tuned kernel and gives exactly its parameters. Regenerate it with
``python tests/ascend/record_launches.py`` when this fails."""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path

from model.testing.tiny import ARCHS
from triton_kernels import tuning

LAUNCHES = Path(__file__).resolve().parents[1] / "ascend" / "launches.json"
MODELS = {*ARCHS, *(f"{arch}-fp8" for arch in ARCHS), "v4-flash", "v41-flash"}


def test_recorded_launches_name_the_kernels_and_their_parameters() -> None:
    entries = json.loads(LAUNCHES.read_text())["launches"]
    assert entries
    for entry in entries:
        importlib.import_module(f"triton_kernels.{entry['op']}")
        kernels = tuning.kernels(entry["op"])
        assert entry["kernel"] in kernels, entry
        params = inspect.signature(kernels[entry["kernel"]].kernel.fn).parameters.values()
        constexpr = [p.name for p in params if "constexpr" in str(p.annotation)]
        assert list(entry["constexprs"]) == constexpr, entry
        assert list(entry["signature"]) == [p.name for p in params if p.name not in constexpr], entry
        assert set(entry["models"]) <= MODELS and entry["models"], entry
    # The releases launch other constexprs than the toys (head counts, head dims): both are recorded.
    assert {model for entry in entries for model in entry["models"]} == MODELS
