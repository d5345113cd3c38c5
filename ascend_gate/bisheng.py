"""BiSheng's back half: a lowering's ttadapter MLIR through ``bishengir-compile`` up to its memory plan.

``ascendnpu-ir`` ships ``bishengir-compile`` for x86_64 but not ``hivmc``, the step after it that makes
the device object. So a compile here runs the whole HFusion and HIVM pipeline, the unified-buffer
planning (``hivm-plan-memory``) included, and then stops with "External hivmc run fails, returning
module before running external compiler": that stop is this stage's pass. ``--save-temps`` keeps the
planned module (``module.hivm.opt.mlir``), in which every UB buffer is a ``hivm.hir.pointer_cast`` at
the byte offset the planner gave it. See docs/ascend-gate.md.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

from ascend_gate import rel_path

# What the shipped binaries cannot do: the planned module is handed to hivmc, which is absent.
_HIVMC_STOP = "External hivmc run fails, returning module before running external compiler"
# BiSheng's wrapper around the error that caused it, never the cause itself.
_WRAPPERS = ("Failed to run BiShengHIR pipeline", "Failed to run BiShengIR pipeline", _HIVMC_STOP)
# A diagnostic (with its location, a source line when the MLIR carries them), or an abort's message.
_ERROR = re.compile(r'^(?:loc\((?:callsite\()?"([^"]+)":(\d+):\d+.*?)?(?:error|LLVM ERROR): (.*)$', re.M)
_OVERFLOW = re.compile(r"ub overflow, requires (\d+) bits")
# "[NOTE] Ub overflow detected; automatically set enable-code-motion to false and retrying compilation."
_DROPPED = re.compile(r"Ub overflow detected; automatically set enable-([\w-]+) to false and retrying")
_CONSTANT = re.compile(r"(%[\w-]+) = arith\.constant (\d+) : i64")
_UB_BUFFER = re.compile(
    r"hivm\.hir\.pointer_cast\(([^)]*)\)[^:]*: memref<([^,>]*)[^>]*#hivm\.address_space<ub>>"
)
TIMEOUT_S = 300  # the slowest of our kernels takes a few seconds


@dataclass(frozen=True)
class Plan:
    """BiSheng's verdict on one lowering."""

    error: str | None  # its first error, verbatim; None when it got through memory planning
    ub_bytes: int  # the end of the highest UB buffer it planned (on an overflow, what it required)
    dropped: tuple[str, ...] = ()  # the optimisations it turned off to make the plan fit
    where: str | None = None  # the error's ``file:line`` in our source, when BiSheng gave one


@cache
def compiler() -> Path:
    spec = importlib.util.find_spec("ascendnpuir")
    if spec is None or spec.origin is None:
        raise SystemExit("the BiSheng stage needs ascendnpu-ir in the gate's venv: run .ci/ascend_gate.sh")
    return Path(spec.origin).parent / "bin" / "bishengir-compile"


@cache
def version() -> str:
    run = subprocess.run([compiler(), "--version"], capture_output=True, text=True, check=True)
    return run.stdout.splitlines()[0].strip()


def options(arch: str, multibuffer: bool) -> list[str]:
    """The options triton-ascend 3.2.0's A2/A3 npubin stage passes with its default ``NPUOptions``
    (``multibuffer`` is the config's), and single-threaded MLIR: the gate already runs one compile per
    core, and threading does not change the plan."""
    return [
        f"--target={arch}",
        f"--enable-auto-multi-buffer={multibuffer}",
        "--enable-auto-bind-sub-block=True",
        "--enable-hfusion-compile=true",
        "--enable-hivm-compile=true",
        "--enable-triton-kernel-compile=true",
        "--mlir-disable-threading",
    ]


def _element_bits(element: str) -> int:
    return int(re.sub(r"\D", "", element) or 8)


def planned_ub_bytes(module: str) -> int:
    """The end of the highest UB buffer in a planned module: offset plus the buffer's static size."""
    constants = dict(_CONSTANT.findall(module))
    end = 0
    for operands, shape in _UB_BUFFER.findall(module):
        *dims, element = shape.split("x")
        numel = 1
        for dim in dims:
            numel *= int(dim)
        size = (numel * _element_bits(element) + 7) // 8
        for operand in operands.split(","):
            end = max(end, int(constants.get(operand.strip(), 0)) + size)
    return end


def _verdict(log: str, returncode: int, planned: Path) -> Plan:
    dropped = tuple(_DROPPED.findall(log))
    causes = [(path, line, message.strip()) for path, line, message in _ERROR.findall(log)]
    causes = [cause for cause in causes if cause[2] not in _WRAPPERS]
    if causes:
        path, line, message = causes[0]
        overflow = _OVERFLOW.search(message)
        where = f"{rel_path(path)}:{line}" if path.endswith(".py") else None
        return Plan(message, int(overflow[1]) // 8 if overflow else 0, dropped, where)
    if _HIVMC_STOP not in log or not planned.is_file():
        last = log.strip().splitlines()[-1] if log.strip() else "no output"
        return Plan(f"exit {returncode} before reaching hivmc, without an error: {last}", 0, dropped)
    return Plan(None, planned_ub_bytes(planned.read_text()), dropped)


def plan(mlir: str, arch: str, multibuffer: bool, cache_dir: Path | None) -> Plan:
    """BiSheng's plan for a ttadapter module, from ``cache_dir`` when this compiler already planned this
    very module with these options."""
    # As triton-ascend does before BiSheng: the mix mode is its own metadata, not an attribute BiSheng takes.
    source = re.sub(r', mix_mode\s*=\s*"[^"]*"', "", mlir)
    flags = options(arch, multibuffer)
    key = hashlib.sha256("\n".join([version(), *flags, source]).encode()).hexdigest()
    cached = cache_dir / f"{key}.json" if cache_dir else None
    if cached and cached.is_file():
        entry = json.loads(cached.read_text())
        return Plan(entry["error"], entry["ub_bytes"], tuple(entry["dropped"]), entry.get("where"))
    with tempfile.TemporaryDirectory() as tmp:
        kernel = Path(tmp, "kernel.ttadapter.mlir")
        kernel.write_text(source)
        command = [compiler(), kernel, *flags, f"--save-temps={tmp}", "-o", Path(tmp, "kernel")]
        try:
            run = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return Plan(f"bishengir-compile ran over {TIMEOUT_S} s", 0)
        result = _verdict(run.stdout + run.stderr, run.returncode, Path(tmp, "module.hivm.opt.mlir"))
    if cached:
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(asdict(result)))
    return result
