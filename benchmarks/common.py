"""What the kernel benchmarks and the sweeps share: the interpreter switch, the device, a timer.

Import this module before any ``triton_kernels`` op module: without a device it sets
``TRITON_INTERPRET=1``, which triton reads when it decorates a kernel (its own library included).
"""

from __future__ import annotations

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

_COPY_BYTES = 256 * 2**20


def device() -> torch.device:
    if runtime.backend() == "cpu" and not runtime.interpreter_active():
        raise SystemExit("no device: run with TRITON_INTERPRET=1 to time the kernels in the interpreter")
    return torch.device(runtime.backend())


def activation_dtype() -> torch.dtype:
    """Activations in bf16 on a device; fp32 under the interpreter, whose bf16 arithmetic is wrong."""
    return torch.float32 if runtime.backend() == "cpu" else torch.bfloat16


def backend_line() -> str:
    mode = "interpreter" if runtime.interpreter_active() else "compiled"
    return f"backend {runtime.backend()} ({runtime.device_name()}, SKU {runtime.sku()}), kernels {mode}"


def time_ms(fn: Callable[[], object], iters: int) -> float:
    """Milliseconds per call: triton's benchmark on a device (it warms up, compiling first), the median
    of ``iters`` runs on a CPU (the interpreter has nothing to warm up)."""
    if runtime.backend() != "cpu":
        return triton.testing.do_bench(fn)
    runs = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - start) * 1e3)
    return statistics.median(runs)


def copy_bandwidth(dev: torch.device) -> float | None:
    """Bytes/s of a device-to-device copy (read + write), the attainable HBM bandwidth; None on a CPU."""
    if runtime.backend() == "cpu":
        return None
    src = torch.empty(_COPY_BYTES, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return 2 * _COPY_BYTES / (time_ms(lambda: dst.copy_(src), 1) * 1e-3)
