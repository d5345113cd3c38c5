"""``python -m autotune --ops all`` on a CPU: a dry run whose files the kernels then launch with."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from autotune.__main__ import main
from benchmarks.cases import OPS
from benchmarks.workload import TINY_PHASES
from model.config import ModelConfig
from model.testing.tiny import toy_config
from triton_kernels import runtime, tuning

pytestmark = pytest.mark.long  # among the longest test files: scheduled first (tests/conftest.py)


def test_dry_run_sweeps_every_op_and_the_kernels_launch_its_choices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DSV4_TUNED_DIR", str(tmp_path / "none"))  # the sweep ignores any file lying around
    start = time.perf_counter()
    written = main(["--ops", "all", "--out", str(tmp_path)])
    print(f"dry run of every op: {time.perf_counter() - start:.1f} s")  # CI's time limit bounds it
    assert sorted(written) == sorted(tmp_path / "cpu" / f"{op}.json" for op in OPS)
    docs = {op: json.loads((tmp_path / "cpu" / f"{op}.json").read_text()) for op in OPS}
    for op, doc in docs.items():
        assert doc["format"] == tuning.FORMAT and doc["op"] == op and doc["dry_run"] is True
        assert (doc["sku"], doc["device"], doc["aicores"]) == ("cpu", "cpu", runtime.num_aicore())
        assert {"python", "torch", "triton"} <= set(doc["versions"]) and doc["date"]
        # The tiny V4.1 launches every tuned kernel of every op.
        assert set(doc["kernels"]) == set(tuning.kernels(op)), op
        for buckets in doc["kernels"].values():
            for entry in buckets.values():
                assert entry["chosen"] in [
                    {k: t[k] for k in ("params", "multibuffer")} for t in entry["trials"]
                ]
                assert entry["ms"] == min(t["ms"] for t in entry["trials"] if t["ms"] is not None)

    # Read back: every launch of every case uses the config the file chose for its bucket.
    monkeypatch.setenv("DSV4_TUNED_DIR", str(tmp_path))
    model = ModelConfig.from_dict(toy_config("v41"))
    launched = 0
    for op, build in OPS.items():
        for phase in TINY_PHASES:
            for case in build(model, phase, torch.device("cpu"), torch.float32):
                with tuning.recording() as launches:
                    case.kernel()
                # Another op's kernel on the way (sparse attention's rope pass) is swept with its own op.
                own = [launch for launch in launches if launch.kernel.op == op]
                for launch in own:
                    chosen = docs[op]["kernels"][launch.kernel.name][launch.bucket]["chosen"]
                    assert tuning.config_id(launch.config) == chosen, (case.name, launch.bucket)
                launched += len(own)
    assert launched >= 40
