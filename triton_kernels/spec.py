"""The parts of a kernel's declaration: its autotune points and the variants it is compiled for.

Each op module exposes ``KERNELS: tuple[tuning.TunedKernel, ...]``, one declaration per kernel: the
launcher launches it, sweeps time it and the Ascend lowering gate lowers it, so the declaration cannot
drift from the kernels (a ``@triton.jit`` function of ``triton_kernels`` that no declaration names is an
error of the gate).
"""

from __future__ import annotations

from dataclasses import dataclass

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
class Variant:
    """Constexpr values the model fixes (not tuned: a head dim, a mode) and the argument types a launch
    with them has: ``signatures`` maps each non-constexpr parameter to a Triton type (``"*fp32"``,
    ``"i32"``), one entry per dtype the op launches it with."""

    constexprs: dict[str, int]
    signatures: tuple[dict[str, str], ...]
