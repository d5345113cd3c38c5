"""What the Ascend gate reads in a lowered kernel: dropped masks, static buffers, scalar fallbacks.

Also the runtime-style specialisation a launch gets. Needs triton-ascend (``.ci/ascend_gate.sh``); see
docs/ascend-gate.md for what each check proves.
"""

from __future__ import annotations

import linecache
import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from triton.backends.ascend.compiler import AscendAttrsDescriptor, _get_triton_adapter_opt_path
from triton.runtime.jit import JITFunction

from ascend_gate import rel_path
from triton_kernels.spec import IN_BOUNDS_MARK

# A tt.load / tt.store line of the TTIR: its operands (pointer, then mask, then other) and its location.
_ACCESS = re.compile(r"\btt\.(load|store) ([^:]*?) : .*loc\((#loc\d*)\)\s*$", re.M)
_LOC_DEF = re.compile(r"^(#loc\d*) = loc\((.*)\)\s*$", re.M)
_LOC_FILE = re.compile(r'^"([^"]+)":(\d+):(\d+)$')
_LOC_CALLSITE = re.compile(r"^callsite\((#loc\d*) at (#loc\d*)\)$")
# TTIR ops that BiSheng lowers to the scalar unit on A2/A3 (correct but slow), by name in the report.
_SCALAR_FALLBACKS = {
    "ordered int compare": re.compile(
        r"arith\.cmpi (?:slt|sle|sgt|sge|ult|ule|ugt|uge), .*: tensor<[^>]*xi\d+>"
    ),
    "int % or /": re.compile(r"arith\.(?:remsi|remui|divsi|divui) .*: tensor<[^>]*xi\d+>"),
    "cumsum": re.compile(r'"tt\.scan"'),
    "histogram": re.compile(r"tt\.histogram"),
    "i64 vector op": re.compile(r"arith\.\w+ .*: tensor<[^>]*xi64>"),
}
_STATIC_BUFFER = re.compile(
    r"= (?:memref\.alloc|tensor\.empty|bufferization\.alloc_tensor)\(\) : (?:memref|tensor)<([^,>]*)>"
)


def _location_keys(mlir: str) -> dict[str, str]:
    """Each ``#loc`` alias spelled out: ``file:line:col`` positions, innermost (a helper's line) first."""
    raw = dict(_LOC_DEF.findall(mlir))

    def spell(text: str, depth: int = 0) -> str:
        if text.startswith("#"):
            return spell(raw.get(text, "?"), depth + 1) if depth < 64 else "?"
        if match := _LOC_FILE.match(text):
            return f"{match[1]}:{match[2]}:{match[3]}"
        if match := _LOC_CALLSITE.match(text):
            return f"{spell(match[1], depth + 1)} <- {spell(match[2], depth + 1)}"
        return text

    return {alias: spell(alias) for alias in raw}


def _accesses(mlir: str) -> Iterator[tuple[str, bool, str]]:
    """(``load`` or ``store``, whether it is masked, spelled-out location) of every memory access."""
    keys = _location_keys(mlir)
    for kind, operands, alias in _ACCESS.findall(mlir):
        count = operands.split("{")[0].count("%")
        yield kind, count >= (2 if kind == "load" else 3), keys.get(alias, alias)


# The adapter's crashes come and go run by run: one compressor kernel's TTIR crashed it 10 times in 40
# runs (25 %), four crashes in a row failed a CI run. Eight tries leave such an input a 1.5e-5 chance
# of failing the gate; a kernel that crashes the adapter every time still fails it.
LINT_TRIES = 8


class LintCrash(RuntimeError):
    """triton-adapter-opt crashed on every try of the dropped-mask lint."""


def dropped_masks(ttir: str, options: dict[str, Any]) -> set[tuple[str, str, int]]:
    """(kind, file, line) of each masked load/store that the adapter's discrete-mask pass makes unmasked.

    The pass replaces a masked access whose mask it cannot prove rectangular by an unmasked one plus a
    select (for a store: load, select, store), so every lane's address is then really accessed.
    """
    masked = {where for kind, is_masked, where in _accesses(ttir) if is_masked}
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp, "kernel.ttir"), Path(tmp, "kernel.dm.mlir")
        src.write_text(ttir)
        on_950 = options.get("compile_on_910_95", False)
        command = [
            _get_triton_adapter_opt_path(),
            str(src),
            f"--discrete-mask-access-conversion=compile-on-910-95={on_950} force-simt-template=False",
            "--mlir-print-debuginfo",
            "--mlir-disable-threading",
            "-o",
            str(dst),
        ]
        # The adapter now and then crashes on input it takes on the next run (see ``lower``), sometimes
        # twice in a row: a few tries, then a crash is the kernel's failure, not the gate's.
        for _ in range(LINT_TRIES):
            if (run := subprocess.run(command, capture_output=True)).returncode == 0:
                break
        else:
            raise LintCrash(
                f"the adapter's discrete-mask pass crashed {LINT_TRIES} times (exit {run.returncode})"
            )
        converted = dst.read_text()
    sites = set()
    for kind, is_masked, where in _accesses(converted):
        if not is_masked and where in masked:
            path, line, _ = where.split(" <- ")[0].rsplit(":", 2)
            sites.add((kind, path, int(line)))
    return sites


def unproven(site: tuple[str, str, int]) -> str | None:
    """The gate's message for a dropped-mask site whose source line does not declare it in bounds."""
    kind, path, line = site
    code = linecache.getline(path, line)
    if IN_BOUNDS_MARK in code:
        return None
    tensor = match[1] if (match := re.search(r"\b(\w+_ptr)\b", code)) else "its tensor"
    return (
        f"{rel_path(path)}:{line}: masked tl.{kind} of {tensor} loses its mask on Ascend (discrete-mask"
        f" pass): clamp or pad its addresses and mark the line '{IN_BOUNDS_MARK} <why>'  [{code.strip()}]"
    )


def static_buffer_bytes(mlir: str) -> int:
    """Sum of the statically shaped buffers the lowered IR allocates: a rough UB indicator."""
    total = 0
    for shape in _STATIC_BUFFER.findall(mlir):
        *dims, elem = shape.split("x")
        bits = int(re.sub(r"\D", "", elem) or 8)
        numel = 1
        for dim in dims:
            numel *= int(dim)
        total += (numel * bits + 7) // 8
    return total


class _Aligned:
    """A pointer argument at an address divisible by 16, as the runtime sees most tensors."""

    @staticmethod
    def data_ptr() -> int:
        return 0


# The specialisations the runtime applies to integer arguments not in ``do_not_specialize``.
SPECIALISATIONS = {"divisible by 16": 16, "equal to 1": 1}


def specialised(
    fn: JITFunction,
    never_one: tuple[str, ...],
    signature: dict[str, str],
    constexprs: dict[str, int],
    value: int,
) -> tuple[dict[str, int], Any]:
    """(constexprs, attrs) of a launch whose pointers are aligned and whose ints are ``value`` (16 for
    those named ``never_one``).

    As ``JITFunction.run`` does: ints equal to 1 become constants, multiples of 16 get divisibility hints.
    """

    def arg(name: str) -> Any:
        if signature[name].startswith("*"):
            return _Aligned()
        if signature[name][0] in "iu":
            return 16 if name in never_one else value
        return 1.5

    values = [constexprs[p.name] if p.is_constexpr else arg(p.name) for p in fn.params]
    attrs = AscendAttrsDescriptor(fn.params, values)
    ones = attrs.get_constants()
    return {**constexprs, **{p.name: 1 for p in fn.params if p.num in ones}}, attrs


def scalar_fallbacks(ttir: str) -> dict[str, int]:
    """Per kind of op BiSheng runs on the scalar unit, how many the TTIR holds (kinds with none left out)."""
    counts = {kind: len(pattern.findall(ttir)) for kind, pattern in _SCALAR_FALLBACKS.items()}
    return {kind: n for kind, n in counts.items() if n}
