"""Every lane's address, masked or not, checked under the interpreter on the lines marked in bounds.

Ascend's discrete-mask pass turns a masked access it cannot prove rectangular into an unmasked one, so
the masked-out lanes are really read (stores: read and written back). The Ascend gate fails such an
access unless its line carries ``IN_BOUNDS_MARK``; this check makes the mark true: every load and store
executed on a marked line must address only bytes inside one tensor argument of its launch.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import triton
from triton.runtime import interpreter

import triton_kernels
from triton_kernels.spec import IN_BOUNDS_MARK

PACKAGE = Path(triton_kernels.__file__).resolve().parent
_TRITON = str(Path(triton.__file__).parent)


def marked_lines(files: list[Path]) -> set[tuple[str, int]]:
    return {
        (str(path), number)
        for path in files
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if IN_BOUNDS_MARK in line and ("tl.load(" in line or "tl.store(" in line)
    }


def _span_bytes(t: torch.Tensor) -> int:
    """Bytes from a view's first element to just past its last one."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


class OutOfBounds(AssertionError):
    pass


@dataclass
class BoundsCheck:
    marked: set[tuple[str, int]]
    extents: list[tuple[int, int]] = field(default_factory=list)  # [start, end) bytes of the launch's tensors
    hits: Counter[tuple[str, int]] = field(default_factory=Counter)

    def _site(self) -> tuple[str, int] | None:
        """The marked line executing the access: the innermost frame outside triton's interpreter (the
        kernel's line, or a @jit helper's)."""
        frame = sys._getframe(3)
        while frame is not None and frame.f_code.co_filename.startswith(_TRITON):
            frame = frame.f_back
        if frame is None or (site := (frame.f_code.co_filename, frame.f_lineno)) not in self.marked:
            return None
        return site

    def check(self, ptrs: Any) -> None:
        if (site := self._site()) is None:
            return
        self.hits[site] += 1
        size = ptrs.get_element_ty().primitive_bitwidth // 8
        low, high = int(ptrs.data.min()), int(ptrs.data.max()) + size
        if not any(start <= low and high <= end for start, end in self.extents):
            raise OutOfBounds(
                f"{site[0]}:{site[1]}: lanes address bytes [{low:#x}, {high:#x}), outside every tensor"
                f" argument of the launch {[(hex(a), hex(b)) for a, b in self.extents]}"
            )

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        executor, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder
        init_args = executor._init_args_hst
        load, store = builder.create_masked_load, builder.create_masked_store

        def record_extents(executor_self: Any, *args: Any) -> Any:
            args_hst, kwargs_hst = init_args(executor_self, *args)
            tensors = [a for a in [*args_hst, *kwargs_hst.values()] if hasattr(a, "data_ptr") and a.numel()]
            self.extents = [(t.data_ptr(), t.data_ptr() + _span_bytes(t)) for t in tensors]
            return args_hst, kwargs_hst

        def checked_load(builder_self: Any, ptrs: Any, *args: Any) -> Any:
            self.check(ptrs)
            return load(builder_self, ptrs, *args)

        def checked_store(builder_self: Any, ptrs: Any, *args: Any) -> Any:
            self.check(ptrs)
            return store(builder_self, ptrs, *args)

        monkeypatch.setattr(executor, "_init_args_hst", record_extents)
        monkeypatch.setattr(builder, "create_masked_load", checked_load)
        monkeypatch.setattr(builder, "create_masked_store", checked_store)
