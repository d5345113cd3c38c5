"""What the kernel benchmarks share: the interpreter switch, a timer and the device peaks.

Import this module before any ``triton_kernels`` op module: without a device it sets
``TRITON_INTERPRET=1``, which triton reads when it decorates a kernel (its own library included).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
from collections.abc import Callable

import torch

if not torch.cuda.is_available() and importlib.util.find_spec("torch_npu") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from triton_kernels import runtime  # noqa: E402

# Nominal peaks by device-name part: HBM bytes/s and dense bf16 FLOP/s.
HBM_PEAK = {"H200": 4.8e12, "H100": 3.35e12, "H800": 3.35e12, "A100": 2.0e12}
BF16_PEAK = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12}


def device() -> torch.device:
    if runtime.backend() == "cpu" and not runtime.interpreter_active():
        raise SystemExit("no device: run with TRITON_INTERPRET=1 to time the kernels in the interpreter")
    return torch.device(runtime.backend())


def time_ms(fn: Callable[[], object], iters: int) -> float:
    """Milliseconds per call: triton's benchmark on a device, the median of ``iters`` runs on a CPU."""
    fn()  # compiles, autotunes
    if runtime.backend() != "cpu":
        return triton.testing.do_bench(fn)
    runs = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - start) * 1e3)
    return statistics.median(runs)


def hbm_peak(dev: torch.device) -> tuple[float, str] | None:
    """Bytes/s: the nominal HBM peak of a known GPU, else a measured device-to-device copy."""
    if runtime.backend() == "cpu":
        return None
    name = runtime.device_name()
    for part, peak in HBM_PEAK.items():
        if part in name:
            return peak, f"{name} HBM"
    buf = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    ms = time_ms(lambda: buf.clone(), 5)
    return 2 * buf.numel() / (ms * 1e-3), "measured copy"


def flops_peak() -> tuple[float, str] | None:
    """Dense bf16 FLOP/s of a known GPU (Ascend's is not published reliably: none)."""
    name = runtime.device_name()
    return next(((peak, f"{name} bf16") for part, peak in BF16_PEAK.items() if part in name), None)


def parse_args(doc: str | None, argv: list[str] | None) -> argparse.Namespace:
    """The options every kernel benchmark takes; prints the backend it runs on."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--large", action="store_true", help="model shapes (slow under the interpreter)")
    parser.add_argument("--iters", type=int, default=3, help="timed runs per op on a CPU")
    args = parser.parse_args(argv)
    mode = "interpreter" if runtime.interpreter_active() else "compiled"
    print(f"backend {runtime.backend()} ({runtime.device_name()}), kernels {mode}")
    return args
