"""The tuned-config file of one op on this SKU (read back by ``triton_kernels.tuning``).

``<out>/<sku>/<op>.json``: the format, op, SKU, device name, backend, the profile's core counts and
on-chip budget, library versions, the date, ``dry_run`` (swept on a CPU: never used on a device), the
model config and phases swept, then per kernel and bucket the chosen config, its time, the cases that
reached the bucket and every trial (config, summed ms or null, error). A bucket where no config was
valid is left out: the kernel's heuristic default applies there.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import torch
import triton

from autotune.sweep import BucketSweep
from benchmarks.workload import Workload
from triton_kernels import runtime, tuning


def versions() -> dict[str, str]:
    found = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__}
    for dist in ("triton-ascend", "torch-npu"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def document(op: str, sweeps: list[BucketSweep], work: Workload) -> dict[str, Any]:
    profile = runtime.profile()
    kernels: dict[str, dict[str, Any]] = {}
    for s in sweeps:
        if (best := s.best) is None:
            continue
        trials = [{**tuning.config_id(t.config), "ms": _ms(t.ms), "error": t.error} for t in s.trials]
        entry = {
            "chosen": tuning.config_id(best.config),
            "ms": _ms(best.ms),
            "cases": s.cases,
            "trials": trials,
        }
        kernels.setdefault(s.kernel.name, {})[s.bucket] = entry
    return {
        "format": tuning.FORMAT,
        "op": op,
        "sku": runtime.sku(),
        "device": runtime.device_name(),
        "backend": runtime.backend(),
        "aicores": profile.aicores,
        "vectorcores": profile.vectorcores,
        "onchip_bytes": profile.onchip_bytes,
        "versions": versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dry_run": runtime.backend() == "cpu",
        "model": work.source,
        "phases": [str(p) for p in work.phases],
        "kernels": kernels,
    }


def _ms(ms: float | None) -> float | None:
    return None if ms is None else round(ms, 4)


def write(out: Path, doc: dict[str, Any]) -> Path:
    """Writes ``doc`` whole (a reader never sees half a file) and returns its path."""
    path = tuning.tuned_path(out, doc["sku"], doc["op"])
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    os.replace(f.name, path)
    return path
