"""Where the operators run: backend, device SKU, core counts and on-chip budget, plus the launch grid.

The backend is decided once per process: ``npu`` when ``torch_npu`` imports and sees a device,
``cuda`` when torch sees a GPU, ``cpu`` otherwise. Public operators run their Triton kernel only on
tensors living on an NPU or a GPU (``use_triton``); on CPU they run the torch reference, and the
Triton launchers are exercised directly under ``TRITON_INTERPRET=1`` in tests. ``DSV4_FORCE_TORCH=1``
sends every operator to its torch reference, for debugging; ``DSV4_TRITON_ON_CPU=1`` together with
``TRITON_INTERPRET=1`` sends CPU tensors to the Triton kernels instead (a whole model on the interpreter).
``DSV4_CHECK_RANGES=1`` makes the operators validate their index ranges, a device-to-host read per
call; it is off in production, where the engine validates the indices once on the host when it builds
the batch, and on in tests (read once per process), never while a trace records (``tracing``: a graph
reads nothing back).

The SKU (``sku()``) is the device name made path-safe; ``DSV4_SKU`` overrides it (tests and sweeps
switch profiles with it). Core counts and the on-chip budget come from the SKU's profile
(``triton_kernels.sku``): for the detected device the driver's answers replace the table's, for an
overridden SKU the table alone speaks, so a test sees exactly the profile it names.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import weakref
from collections.abc import MutableMapping

import torch
import triton

from triton_kernels.sku import ASCEND_UB_BYTES, CPU, PROFILES, SkuProfile, find_profile, slug
from triton_kernels.spec import TuneConfig

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


def check_ranges() -> bool:
    return _ranges_asked() and not tracing()


@functools.cache
def _ranges_asked() -> bool:
    return os.environ.get("DSV4_CHECK_RANGES", "0").lower() in _TRUE


_TRACE_MODES = (torch._C._TorchDispatchModeKey.PROXY, torch._C._TorchDispatchModeKey.FAKE)


def tracing() -> bool:
    """A trace is being recorded (make_fx / export's proxy or fake mode, or dynamo)."""
    return (
        any(torch._C._get_dispatch_mode(key) is not None for key in _TRACE_MODES)
        or torch.compiler.is_compiling()
    )


def trace_recorder() -> object | None:
    """The mode recording the trace under way (make_fx / export's proxy mode): it lives as long as the
    trace, so what one trace computes can be kept for it alone. None under dynamo or outside a trace."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY)


# A trace's recorder -> id of a cache -> that cache's own for the trace (of the trace's tensors).
_PER_TRACE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def per_trace(cache: MutableMapping) -> MutableMapping | None:
    """Where a reference keeps what it computes once per step (``cache``, a module's, keyed by the tensors
    it was computed from): ``cache`` itself outside a trace; while one records, an empty one of the same
    kind that lives as long as the trace (its graph then computes each entry once per replay); under
    dynamo, None (nothing outlives a call)."""
    if not tracing():
        return cache
    recorder = trace_recorder()
    if recorder is None:
        return None
    return _PER_TRACE.setdefault(recorder, {}).setdefault(id(cache), type(cache)())


def interpreter_active() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in _TRUE


if interpreter_active():  # every op module imports this one: their kernels interpret with the fast path
    from triton_kernels import interpreter

    interpreter.install()


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


def sku() -> str:
    return slug(os.environ.get("DSV4_SKU") or device_name())


def profile() -> SkuProfile:
    """The profile of ``sku()``. An overridden SKU must be in the table."""
    forced = os.environ.get("DSV4_SKU")
    if not forced:
        return _detected_profile()
    found = find_profile(slug(forced))
    if found is None:
        known = ", ".join(p.name for p in PROFILES)
        raise ValueError(f"DSV4_SKU: {forced!r} matches no SKU profile (known: {known})")
    return found


@functools.cache
def _driver_properties() -> dict[str, int]:
    # The NPU driver needs CANN at run time; a failed query falls back to the table.
    try:
        device = torch.npu.current_device() if backend() == "npu" else torch.cuda.current_device()
        return dict(triton.runtime.driver.active.utils.get_device_properties(device))
    except Exception:
        return {}


@functools.cache
def _detected_profile() -> SkuProfile:
    name, kind = slug(device_name()), backend()
    if kind == "cpu":
        return CPU
    base = find_profile(name)
    props = _driver_properties()
    if kind == "npu":
        # An unknown Ascend SKU is taken for a 24-core A2/A3 die unless the driver answers.
        base = base or SkuProfile(name, 24, 48, ASCEND_UB_BYTES)
        aicores = int(props.get("num_aicore", base.aicores))
        vectorcores = int(props.get("num_vectorcore", base.vectorcores))
        return dataclasses.replace(base, aicores=aicores, vectorcores=vectorcores)
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    base = base or SkuProfile(name, sms, sms, _CUDA_SMEM_FALLBACK)
    smem = int(props.get("max_shared_mem", base.onchip_bytes))
    return dataclasses.replace(base, aicores=sms, vectorcores=sms, onchip_bytes=smem)


def num_aicore() -> int:
    return profile().aicores


def num_vectorcore() -> int:
    return profile().vectorcores


def onchip_bytes() -> int:
    """Per-program on-chip budget that tune configs are checked against."""
    return profile().onchip_bytes


def fits(config: TuneConfig) -> bool:
    return config.resident_bytes <= onchip_bytes()


def dot_dim(n: int) -> int:
    """``n`` padded for a ``tl.dot`` operand: a power of two, and at least the 16 ``tl.dot`` needs."""
    return max(16, triton.next_power_of_2(n))


def grid(n_tasks: int, uses_cube: bool) -> tuple[int]:
    """Persistent 1-D grid: one program per AI core (cube kernels) or vector core, never more than tasks."""
    cores = num_aicore() if uses_cube else num_vectorcore()
    return (max(1, min(n_tasks, cores, _MAX_GRID)),)


def memory_bytes() -> int:
    """The device's total memory: host RAM when the backend is the CPU."""
    kind = backend()
    if kind == "npu":
        return torch.npu.mem_get_info()[1]
    if kind == "cuda":
        return torch.cuda.mem_get_info()[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
