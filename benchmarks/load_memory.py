"""Load memory on a width-faithful synthetic checkpoint: resident weights against checkpoint bytes, and
the host memory the loader needs on top of them.

``python -m benchmarks.load_memory [--like v4-flash] [--layers 2] [--experts 16]
[--layout official|msmodelslim|msmodelslim-w4a8] [--dir DIR] [--device cpu] [--dtype bfloat16]``

Writes the checkpoint (``model.testing.release_like``; into ``--dir`` if given and empty, else a temporary
folder), then loads it in a fresh process so the idle RSS is that of the imports alone, and prints
- resident weight bytes / checkpoint tensor bytes (goal <= 1.05: the weights stay as stored),
- peak host RSS during the load minus the idle RSS, less the resident weights when they live in host
  memory (``--device cpu``), against the largest tensor (goal <= 2x: the loader streams),
- the load time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from model.checkpoint import load_model, placement, stored_tensors
from model.testing.release_like import LAYOUTS, LIKES, write_like


def _status(field: str) -> int:
    """A ``/proc/self/status`` memory field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise SystemExit(f"no {field} in /proc/self/status: this benchmark needs Linux")


def resident_bytes(model: torch.nn.Module) -> int:
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.state_dict().values()
    }
    return sum(storages.values())


def measure(path: Path, device: str, dtype: str) -> dict[str, float]:
    """Load ``path`` once in this process and report its memory and time."""
    where, compute = placement(device, dtype)
    stored = stored_tensors(path)
    Path("/proc/self/clear_refs").write_text("5")  # restart the peak-RSS count here
    idle = _status("VmRSS")
    start = time.perf_counter()
    model = load_model(path, compute, where)
    seconds = time.perf_counter() - start
    peak = _status("VmHWM")
    weights = resident_bytes(model)
    on_host = weights if where.type == "cpu" else 0
    return {
        "checkpoint_bytes": sum(t.nbytes for t in stored.values()),
        "resident_weight_bytes": weights,
        "largest_tensor_bytes": max(t.nbytes for t in stored.values()),
        "peak_rss_minus_idle_bytes": peak - idle,
        "load_overhead_bytes": peak - idle - on_host,
        "load_seconds": seconds,
    }


def report(numbers: dict[str, float], layout: str) -> None:
    gib = 2**30
    ratio = numbers["resident_weight_bytes"] / numbers["checkpoint_bytes"]
    overhead = numbers["load_overhead_bytes"] / numbers["largest_tensor_bytes"]
    print(f"layout {layout}: checkpoint {numbers['checkpoint_bytes'] / gib:.3f} GiB, resident weights "
          f"{numbers['resident_weight_bytes'] / gib:.3f} GiB: ratio {ratio:.4f} (goal <= 1.05)")  # fmt: skip
    print(f"peak RSS - idle {numbers['peak_rss_minus_idle_bytes'] / gib:.3f} GiB; load overhead "
          f"{numbers['load_overhead_bytes'] / gib:.3f} GiB = {overhead:.2f}x the largest tensor "
          f"({numbers['largest_tensor_bytes'] / gib:.3f} GiB; goal <= 2x)")  # fmt: skip
    print(f"load {numbers['load_seconds']:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--like", choices=tuple(LIKES), default="v4-flash")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--layout", choices=LAYOUTS, default="official")
    parser.add_argument("--dir", type=Path, help="reuse or write the checkpoint here")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.dir, args.device, args.dtype)))
        return
    with tempfile.TemporaryDirectory() as scratch:
        path = args.dir or Path(scratch)
        if not (path / "config.json").exists():
            start = time.perf_counter()
            write_like(path, args.like, args.layers, args.experts, args.layout)
            print(f"wrote {args.like} x {args.layers} layers x {args.experts} experts ({args.layout}) "
                  f"to {path} in {time.perf_counter() - start:.1f} s")  # fmt: skip
        child = [sys.executable, "-m", "benchmarks.load_memory", "--measure", "--dir", str(path)]
        child += ["--device", args.device, "--dtype", args.dtype]
        result = subprocess.run(child, check=True, capture_output=True, text=True)
        report(json.loads(result.stdout.splitlines()[-1]), args.layout)


if __name__ == "__main__":
    main()
