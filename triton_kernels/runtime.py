"""Where the operators run: backend, device, core counts and on-chip budget, plus launch helpers.

The backend is decided once per process: ``npu`` when ``torch_npu`` imports and sees a device,
``cuda`` when torch sees a GPU, ``cpu`` otherwise. Public operators run their Triton kernel only on
tensors living on an NPU or a GPU (``use_triton``); on CPU they run the torch reference, and the
Triton launchers are exercised directly under ``TRITON_INTERPRET=1`` in tests. ``DSV4_FORCE_TORCH=1``
sends every operator to its torch reference, for debugging; ``DSV4_TRITON_ON_CPU=1`` together with
``TRITON_INTERPRET=1`` sends CPU tensors to the Triton kernels instead (a whole model on the interpreter).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton

from triton_kernels.spec import KernelSpec, TuneConfig

ASCEND_UB_BYTES = 192 * 1024
# Used when the driver cannot be asked (it fails on machines without the device's runtime).
_ASCEND_AICORES = {"Ascend910B3": 20, "Ascend910B4": 20}
_DEFAULT_ASCEND_AICORES = 24
_CUDA_SMEM_FALLBACK = 227 * 1024
_MAX_GRID = 65535
_TRUE = ("1", "true", "yes", "on")


@functools.cache
def backend() -> str:
    if _npu_present():
        return "npu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _npu_present() -> bool:
    try:
        import torch_npu  # noqa: F401
    # Without CANN, importing torch_npu fails with errors other than ImportError.
    except Exception:
        return False
    return torch.npu.is_available()


def force_torch() -> bool:
    return os.environ.get("DSV4_FORCE_TORCH", "0").lower() in _TRUE


def interpreter_active() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in _TRUE


def triton_on_cpu() -> bool:
    return interpreter_active() and os.environ.get("DSV4_TRITON_ON_CPU", "0").lower() in _TRUE


def use_triton(tensor: torch.Tensor) -> bool:
    on_device = tensor.device.type in ("npu", "cuda") or (tensor.device.type == "cpu" and triton_on_cpu())
    return on_device and not force_torch()


@functools.cache
def device_name() -> str:
    kind = backend()
    if kind == "npu":
        return torch.npu.get_device_name()
    if kind == "cuda":
        return torch.cuda.get_device_name()
    return "cpu"


@functools.cache
def _driver_properties() -> dict[str, int]:
    # The NPU driver needs CANN at run time; a failed query falls back to tables.
    try:
        device = torch.npu.current_device() if backend() == "npu" else torch.cuda.current_device()
        return dict(triton.runtime.driver.active.utils.get_device_properties(device))
    except Exception:
        return {}


@functools.cache
def num_aicore() -> int:
    kind = backend()
    if kind == "npu":
        fallback = _ASCEND_AICORES.get(device_name(), _DEFAULT_ASCEND_AICORES)
        return int(_driver_properties().get("num_aicore", fallback))
    if kind == "cuda":
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    # Interpreted programs cost ~1.3 ms each: few programs keep tests fast.
    return min(4, os.cpu_count() or 1)


@functools.cache
def num_vectorcore() -> int:
    if backend() == "npu":
        return int(_driver_properties().get("num_vectorcore", 2 * num_aicore()))
    return num_aicore()


@functools.cache
def onchip_bytes() -> int:
    """Per-program on-chip budget that tune configs are checked against."""
    if backend() == "cuda":
        return int(_driver_properties().get("max_shared_mem", _CUDA_SMEM_FALLBACK))
    # CPU checks against the Ascend budget so a config rejected on the NPU is rejected in tests too.
    return ASCEND_UB_BYTES


def fits(config: TuneConfig) -> bool:
    return config.resident_bytes <= onchip_bytes()


def grid(spec: KernelSpec, n_tasks: int) -> tuple[int]:
    """Persistent 1-D grid: one program per core that the kernel kind runs on, never more than tasks."""
    cores = num_aicore() if spec.uses_cube else num_vectorcore()
    return (max(1, min(n_tasks, cores, _MAX_GRID)),)


def _timer_bench(fn: Callable[[], Any], quantiles: Sequence[float] | None = None, **_: Any) -> Any:
    start = time.perf_counter()
    fn()
    ms = (time.perf_counter() - start) * 1e3
    return [ms] * len(quantiles) if quantiles else ms


def _do_bench(fn: Callable[[], Any], quantiles: Sequence[float] | None = None) -> Any:
    # Device benchmarking needs an active driver, which neither the interpreter nor a CPU has.
    if interpreter_active() or backend() == "cpu":
        return _timer_bench(fn, quantiles)
    return triton.testing.do_bench(fn, quantiles=quantiles)


def autotune(configs: Sequence[TuneConfig], key: list[str]) -> Callable[[Any], Any]:
    """``triton.autotune`` over the configs that fit on chip, with a benchmark that works everywhere."""
    fitting = [c for c in configs if fits(c)]
    if not fitting:
        smallest = min(c.resident_bytes for c in configs)
        raise ValueError(
            f"configs: smallest resident footprint {smallest} B exceeds budget {onchip_bytes()} B"
        )
    # multibuffer is an Ascend compile option; the interpreter and CUDA reject unknown launch keywords.
    npu = backend() == "npu"
    tuned = [triton.Config({**c.params, **({"multibuffer": c.multibuffer} if npu else {})}) for c in fitting]
    return triton.autotune(tuned, key=key, do_bench=_do_bench)
