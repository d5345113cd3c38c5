"""What every op file declares about its Triton kernels.

Each op module exposes ``KERNELS: tuple[KernelSpec, ...]``. The tuned kernels of ``tuning``
launch with one of the configs (refusing those whose footprint does not fit the SKU's on-chip
budget), sweeps time them, and the Ascend lowering gate reads everything, so the declaration
cannot drift from the kernels: a ``@triton.jit`` function of ``triton_kernels`` that no spec
names is an error of the gate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Ends the source line of a masked load/store whose addresses are valid for every lane, masked or not
# (indices clamped, operands padded): Ascend's discrete-mask pass may turn it into an unmasked access.
# The Ascend gate fails on such an access without it; the interpreter tests check every lane of it.
IN_BOUNDS_MARK = "# in-bounds:"


@dataclass(frozen=True)
class TuneConfig:
    """One point of an autotune space.

    ``params`` are the constexpr tile sizes passed to the kernel. ``ub_bytes`` is the
    unified-buffer footprint of one program with this config (every tensor live at once,
    counted once); with ``multibuffer`` the compiler double-buffers, so twice that must fit.
    """

    params: dict[str, int]
    ub_bytes: int
    multibuffer: bool = True

    @property
    def resident_bytes(self) -> int:
        return self.ub_bytes * (2 if self.multibuffer else 1)


@dataclass(frozen=True)
class KernelSpec:
    """A kernel, the argument types it is compiled for and its autotune space.

    ``signatures`` maps each non-constexpr parameter to a Triton type (``"*fp32"``, ``"i32"``);
    one entry per dtype variant the op launches. ``constexprs`` fixes constexpr parameters
    that are not tuned (e.g. a head dim) to representative model values. ``uses_cube`` is
    True for kernels with ``tl.dot``: they launch one program per AI core (cube + vector,
    Ascend ``mix`` mode); the others launch one per vector core (``aiv``). The runtime specialises
    integer arguments equal to 1 or divisible by 16 unless the kernel lists them in
    ``do_not_specialize`` (batch sizes and counts do, so each batch size does not compile again);
    the gate lowers each kernel once with each hint.
    """

    kernel: Any
    signatures: tuple[dict[str, str], ...]
    configs: tuple[TuneConfig, ...]
    constexprs: dict[str, int] = field(default_factory=dict)
    uses_cube: bool = False
    # Integer arguments no valid launch passes as 1: the gate's "equal to 1" sweep leaves them at 16.
    never_one: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__ if hasattr(self.kernel, "fn") else self.kernel.__name__
