"""What each device SKU offers the kernels: core counts, on-chip budget and nominal peaks.

A SKU is named by its device name made path-safe (``Ascend910B2``, ``Ascend910_9392``,
``NVIDIA_H100_80GB_HBM3``, ``cpu``): it names the directory of tuned configs. A profile covers
every SKU whose name contains the profile's name, so ``Ascend910_93`` covers the A3 dies.

Peaks are nominal, for rooflines only. Ascend's are low-confidence: the BF16 peak is derived
(cubes x 16x16x16 MACs x 2 x 1.8 GHz) and the HBM bandwidth is not reliably published, which is why
the benchmarks measure bandwidth with a copy kernel before claiming a fraction of it. INT8 is twice
BF16 on both families.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass

ASCEND_UB_BYTES = 192 * 1024
_NVIDIA_HOPPER_SMEM = 227 * 1024  # the opt-in shared memory of one block
_NVIDIA_A100_SMEM = 163 * 1024


@dataclass(frozen=True)
class SkuProfile:
    """``aicores``: programs of a kernel using the cube unit (``tl.dot``), SMs on NVIDIA;
    ``vectorcores``: programs of a vector-only kernel; ``onchip_bytes``: the per-program budget tune
    configs are checked against (unified buffer, shared memory). Peaks in bytes/s and op/s, ``None``
    where unknown."""

    name: str
    aicores: int
    vectorcores: int
    onchip_bytes: int
    hbm_bytes_per_s: float | None = None
    bf16_flops: float | None = None

    @property
    def int8_ops(self) -> float | None:
        return None if self.bf16_flops is None else 2 * self.bf16_flops


def _ascend(name: str, aicores: int, hbm: float) -> SkuProfile:
    return SkuProfile(name, aicores, 2 * aicores, ASCEND_UB_BYTES, hbm, aicores * 4096 * 2 * 1.8e9)


# Interpreted programs cost ~1.3 ms each: few programs keep tests fast. The CPU checks configs against
# the Ascend budget so that a config the NPU would reject is rejected in tests too.
CPU = SkuProfile("cpu", min(4, os.cpu_count() or 1), min(4, os.cpu_count() or 1), ASCEND_UB_BYTES)
PROFILES: tuple[SkuProfile, ...] = (
    _ascend("Ascend910B2", 24, 1.6e12),
    _ascend("Ascend910B3", 20, 1.6e12),
    _ascend("Ascend910B4", 20, 0.8e12),  # 32 GB of HBM: the narrow part
    _ascend("Ascend910_93", 24, 1.6e12),  # one A3 die (Ascend910_93xx)
    SkuProfile("NVIDIA_H200", 132, 132, _NVIDIA_HOPPER_SMEM, 4.8e12, 989e12),
    SkuProfile("NVIDIA_H100", 132, 132, _NVIDIA_HOPPER_SMEM, 3.35e12, 989e12),
    SkuProfile("NVIDIA_H800", 132, 132, _NVIDIA_HOPPER_SMEM, 3.35e12, 989e12),
    SkuProfile("NVIDIA_A100", 108, 108, _NVIDIA_A100_SMEM, 2.0e12, 312e12),
    CPU,
)


@functools.cache
def slug(device_name: str) -> str:
    """The SKU name of a device: its name with every run of other characters than [A-Za-z0-9._-] as ``_``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", device_name.strip())


def find_profile(sku: str) -> SkuProfile | None:
    return next((p for p in PROFILES if p.name in sku), None)
