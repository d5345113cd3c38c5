"""Ascend lowering gate: every Triton kernel of ``triton_kernels``, compiled by triton-ascend and BiSheng.

The interpreter proves that a kernel computes the right thing, not that Triton-Ascend can compile it.
This lowers each (kernel, dtype variant, autotune config) that the op modules declare in ``KERNELS``,
each kernel once more with the runtime's specialisation hints, and every launch recorded from the tiny
models, through triton-ascend's ``ttir`` and ``ttadapter`` stages for the A2/A3 target (and, asked for,
the adapter's Ascend 950 variant): that is the MLIR CANN's BiSheng compiler takes. Every lowering's
masked accesses that Ascend unmasks must be marked in bounds (``ir``). Every A2/A3 lowering then goes
through ``bishengir-compile`` up to its unified-buffer plan (``bisheng``; the binary needs ``hivmc``,
which is not shipped). It needs triton-ascend, which cannot share an environment with upstream
triton: ``.ci/ascend_gate.sh`` builds one. See docs/ascend-gate.md.

    python -m ascend_gate [--targets a2,a3,950] [--module tests/ascend/bad_kernels.py ...]
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import multiprocessing
import os
import pkgutil
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import IO, Any

# Read when @triton.jit decorates, triton's own library included: interpreted functions do not compile.
os.environ.pop("TRITON_INTERPRET", None)
# The adapter keeps the kernels' source locations in the MLIR, so BiSheng's errors name our lines. Only
# locations change: BiSheng plans the same buffers with them as without (checked on 19 lowerings).
os.environ["TRITON_DISABLE_LINE_INFO"] = "false"

from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.errors import CompilationError

import triton_kernels
from ascend_gate import bisheng, rel_path
from triton_kernels.sku import ASCEND_UB_BYTES
from triton_kernels.spec import TuneConfig
from triton_kernels.tuning import TunedKernel

try:  # upstream triton has neither the Ascend backend nor this helper
    from triton.backends.ascend.compiler import AscendBackend
    from triton.runtime.jit import JITFunction, KernelInterface, get_jit_fn_file_line

    from ascend_gate.ir import (
        SPECIALISATIONS,
        LintCrash,
        dropped_masks,
        scalar_fallbacks,
        specialised,
        static_buffer_bytes,
        unproven,
    )
except ImportError as exc:
    raise SystemExit(
        f"the Ascend gate needs triton-ascend, in a venv of its own: run .ci/ascend_gate.sh ({exc})"
    ) from None

# Every config's IR estimate, single-buffered, should leave BiSheng a fifth of the unified buffer for its
# own temporaries: on overflow it silently drops code motion, then multibuffering.
UB_BUDGET_BYTES = int(0.8 * ASCEND_UB_BYTES)
# (label, target, options). The 950 pass switches the adapter's variant; the front end stays A2/A3's.
TARGETS: tuple[tuple[str, GPUTarget, dict[str, Any]], ...] = (
    ("A2/A3", GPUTarget("npu", "Ascend910B2", 0), {}),
    (
        "950",
        GPUTarget("npu", "Ascend910_9589", 0),
        {"compile_on_910_95": True, "enable_select_analysis": True},
    ),
)
_MIX_MODE = re.compile(r'mix_mode\s*=\s*"(\w+)"')
# ``file:line:col: error: msg``, or ``loc("file":line:col): error: msg`` from a handler without sources.
_MLIR_ERROR = re.compile(r'^(?:loc\(")?([^\s"]+?)"?:(\d+):\d+\)?: error: (.*)$', re.M)


class LoweringError(Exception):
    pass


@dataclass
class Report:
    label: str
    where: str
    configs: tuple[TuneConfig, ...]
    errors: list[str] = field(default_factory=list)
    mix_modes: set[str] = field(default_factory=set)
    # Per config index: the largest static buffer estimate over dtype variants and targets.
    estimates: dict[int, int] = field(default_factory=dict)
    lowerings: int = 0
    # Masked accesses the discrete-mask pass makes unmasked, as (kind, file, line); and those not marked.
    dropped: set[tuple[str, str, int]] = field(default_factory=set)
    unproven: set[tuple[str, str, int]] = field(default_factory=set)
    # Per kind of scalar fallback, the most of its ops in one lowering's TTIR.
    fallbacks: dict[str, int] = field(default_factory=dict)
    sweeps: int = 0  # lowerings with runtime-style specialisation, and how many lowered
    swept: int = 0
    # Per config index: BiSheng's worst plan over dtype variants (a failure, else the largest UB).
    plans: dict[int, bisheng.Plan] = field(default_factory=dict)
    # Lowerings through BiSheng, those it failed, and the first of its errors.
    compiled: int = 0
    compile_failures: int = 0
    bisheng_error: str | None = None

    @property
    def verdict(self) -> str:
        return "FAIL" if self.errors else "PASS"

    def plan(self, index: int, result: bisheng.Plan, context: str) -> None:
        self.compiled += 1
        if (error := result.error) is None and result.ub_bytes > ASCEND_UB_BYTES:
            error = f"plans {_kib(result.ub_bytes)} of UB, over the {_kib(ASCEND_UB_BYTES)} unified buffer"
        if error is not None:
            self.compile_failures += 1
            message = f"{context} bisheng: {result.where or self.where}: {error}"
            self.errors.append(message)
            self.bisheng_error = self.bisheng_error or message
        worst = self.plans.get(index)
        if worst is None or _severity(worst) < _severity(result):
            self.plans[index] = result

    def count_fallbacks(self, ttir: str) -> None:
        for kind, found in scalar_fallbacks(ttir).items():
            self.fallbacks[kind] = max(self.fallbacks.get(kind, 0), found)

    def lint(self, ttir: str, options: dict[str, Any], context: str) -> None:
        """Records the lowering's dropped-mask sites; an unmarked one is an error."""
        try:
            sites = dropped_masks(ttir, options)
        except LintCrash as err:
            self.errors.append(f"{context} dropped-mask lint: {err}")
            return
        for site in sites - self.dropped:
            self.dropped.add(site)
            if (message := unproven(site)) is not None:
                self.unproven.add(site)
                self.errors.append(f"{context} dropped mask: {message}")

    def over_declared(self, index: int) -> bool:
        return self.estimates.get(index, 0) > self.configs[index].ub_bytes

    def over_budget(self, index: int) -> bool:
        return self.estimates.get(index, 0) > UB_BUDGET_BYTES


def _severity(plan: bisheng.Plan) -> tuple[bool, int]:
    """A failure is worse than any plan; then the more UB, the worse."""
    return plan.error is not None, plan.ub_bytes


def _where(fn: JITFunction) -> str:
    path, line = get_jit_fn_file_line(fn)
    return f"{rel_path(path)}:{line}"


def _jit(obj: Any) -> JITFunction | None:
    # Autotuner and Heuristics wrap the JITFunction in ``.fn``.
    while isinstance(obj, KernelInterface) and not isinstance(obj, JITFunction):
        obj = obj.fn
    return obj if isinstance(obj, JITFunction) else None


def _referenced(fn: JITFunction) -> Iterator[JITFunction]:
    """The @jit functions a kernel's body names: helpers it calls (or passes on)."""

    def resolve(node: ast.AST) -> Any:
        if isinstance(node, ast.Name):
            return fn.__globals__.get(node.id)
        if isinstance(node, ast.Attribute):
            return getattr(resolve(node.value), node.attr, None)
        return None

    for node in ast.walk(fn.parse()):
        if (helper := _jit(resolve(node))) is not None:
            yield helper


def _modules(paths: list[str]) -> Iterator[tuple[str, ModuleType | Exception]]:
    package = pkgutil.walk_packages(triton_kernels.__path__, "triton_kernels.")
    for item in paths or [m.name for m in package]:
        try:
            if item.endswith(".py"):
                spec = importlib.util.spec_from_file_location(Path(item).stem, item)
                assert spec is not None and spec.loader is not None
                module = importlib.util.module_from_spec(spec)
                sys.modules[spec.name] = module
                spec.loader.exec_module(module)
            else:
                module = importlib.import_module(item)
            yield module.__name__.rsplit(".", 1)[-1], module
        except Exception as exc:  # an op module that does not import under triton-ascend fails the gate
            yield item, exc


@contextmanager
def _stderr_to(log: IO[bytes]) -> Iterator[None]:
    # MLIR diagnostics of the in-process passes go to fd 2, not into the exception.
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _describe(exc: Exception, log: str, fn: JITFunction, known: dict[str, JITFunction]) -> str:
    """The first error as ``file:line: message``, pointing into our source wherever possible."""
    if isinstance(exc, CompilationError):
        # An error inside a called @jit helper is re-raised at each call site; the innermost is the cause.
        chain = [exc]
        while isinstance(chain[-1].__cause__, CompilationError):
            chain.append(chain[-1].__cause__)
        for err in reversed(chain):
            if err.src in known and hasattr(err.node, "lineno"):
                path, first = get_jit_fn_file_line(known[err.src])
                code = err.src.splitlines()[err.node.lineno - 1].split("#")[0].strip()
                cause = chain[-1].__cause__
                message = f"{type(cause).__name__}: {cause}" if cause else chain[-1].error_message
                return f"{rel_path(path)}:{first + err.node.lineno - 1}: {message}  [{code}]"
    stderr = getattr(exc, "stderr", None) or b""
    if match := _MLIR_ERROR.search(stderr.decode(errors="replace") + log):
        return f"{rel_path(match[1])}:{match[2]}: {match[3]}"
    if isinstance(exc, subprocess.CalledProcessError) and exc.returncode < 0:
        return f"{_where(fn)}: triton-adapter-opt crashed ({signal.Signals(-exc.returncode).name})"
    lines = str(exc).strip().splitlines()
    return f"{_where(fn)}: {type(exc).__name__}: {lines[0] if lines else ''}"


def lower(
    fn: JITFunction,
    signature: dict[str, str],
    constexprs: dict[str, int],
    target: GPUTarget,
    options: dict[str, Any],
    known: dict[str, JITFunction],
    attrs: Any = None,
) -> tuple[str, str]:
    """The kernel's TTIR and ttadapter MLIR. ``triton.compile`` would go on to the npubin stage, which
    needs CANN."""
    backend = AscendBackend(target)
    opts = backend.parse_options(options)
    stages: dict[str, Any] = {}
    backend.add_stages(stages, opts)
    metadata = {"hash": "ascend-check", "target": target, **opts.__dict__}
    # triton-adapter-opt now and then crashes on a kernel it lowers fine on the next run: a crash
    # gets one retry, a real incompatibility (which crashes every time) still fails.
    for attempt in range(2):
        stage = "ast->ttir"
        with tempfile.TemporaryFile() as log:
            with _stderr_to(log):
                try:
                    context = ir.context()
                    ir.load_dialects(context)
                    backend.load_dialects(context)
                    module = ASTSource(fn, signature, constexprs, attrs).make_ir(
                        opts, backend.get_codegen_implementation(), backend.get_module_map(), context
                    )
                    stage = "ttir"
                    module = stages[stage](module, metadata)
                    ttir = str(module)
                    stage = "ttadapter"
                    return ttir, stages[stage](module, metadata)
                except Exception as exc:
                    failure = exc
            crashed = isinstance(failure, subprocess.CalledProcessError) and failure.returncode < 0
            if crashed and attempt == 0:
                continue
            log.seek(0)
            raise LoweringError(
                f"{stage}: {_describe(failure, log.read().decode(errors='replace'), fn, known)}"
            )
    raise AssertionError("unreachable")


def _assignments(values: dict[str, int], sep: str = ",") -> str:
    return sep.join(f"{k}={v}" for k, v in values.items())


def _variant(signature: dict[str, str]) -> str:
    return "/".join(t[1:] for t in signature.values() if t.startswith("*"))


def check(
    tuned: TunedKernel,
    module: str,
    known: dict[str, JITFunction],
    targets: tuple[tuple[str, GPUTarget, dict[str, Any]], ...] = TARGETS[:1],
    sweep: bool = True,
    plan_cache: Path | None = None,
) -> Report:
    """Every lowering of ``tuned``; each A2/A3 one through BiSheng too (``plan_cache``: its results)."""
    fn = tuned.kernel
    report = Report(f"{module}.{tuned.name}", _where(fn), tuned.configs)
    if not tuned.variants or not all(v.signatures for v in tuned.variants):
        report.errors.append(
            f"{report.where}: {tuned.name} declares a variant without signatures: nothing to lower"
        )
    expected = "mix" if tuned.uses_cube else "aiv"
    for variant in tuned.variants:
        fixed = _assignments(variant.constexprs)
        for index, config in enumerate(tuned.configs):
            params = _assignments({**variant.constexprs, **config.params})
            for signature in variant.signatures:
                for label, target, options in targets:
                    report.lowerings += 1
                    context = f"[{label} {_variant(signature)} {params}]"
                    try:
                        ttir, mlir = lower(
                            fn,
                            signature,
                            {**variant.constexprs, **config.params},
                            target,
                            {**options, "multibuffer": config.multibuffer},
                            known,
                        )
                    except LoweringError as exc:
                        report.errors.append(f"{context} {exc}")
                        continue
                    report.lint(ttir, options, context)
                    report.count_fallbacks(ttir)
                    mode = _MIX_MODE.search(mlir)
                    mix = mode[1] if mode else "?"
                    report.mix_modes.add(mix)
                    if mix != expected:
                        cores = "AI" if tuned.uses_cube else "vector"
                        report.errors.append(
                            f"{context} {report.where}: lowers to mix_mode={mix} but uses_cube="
                            f"{tuned.uses_cube} launches it on {cores} cores (expected mix_mode={expected})"
                        )
                    estimate = static_buffer_bytes(mlir)
                    report.estimates[index] = max(report.estimates.get(index, 0), estimate)
                    # BiSheng's 950 back half is another binary with other options: A2/A3 only.
                    if label == TARGETS[0][0]:
                        plan = bisheng.plan(mlir, target.arch, config.multibuffer, plan_cache)
                        report.plan(index, plan, context)
        # The runtime specialises every launch; once per variant (first dtypes and config) is enough for
        # the front end and the adapter, whose work does not depend on tile sizes.
        if not sweep or not variant.signatures:
            continue
        label, target, options = targets[0]
        signature, config = variant.signatures[0], tuned.configs[0]
        for name, value in SPECIALISATIONS.items():
            report.sweeps += 1
            constexprs, attrs = specialised(
                fn, tuned.never_one, signature, {**variant.constexprs, **config.params}, value
            )
            context = f"[{label} {_variant(signature)} {fixed} {name}]"
            try:
                ttir, _ = lower(fn, signature, constexprs, target, options, known, attrs)
            except LoweringError as exc:
                report.errors.append(f"{context} {exc}")
                continue
            report.swept += 1
            report.lint(ttir, options, context)
    for index, config in enumerate(tuned.configs):
        if report.over_budget(index):
            report.errors.append(
                f"{report.where}: {config.params} estimates {_kib(report.estimates[index])} of static buffers"
                f" in the IR, over the budget of {_kib(UB_BUDGET_BYTES)} (80 % of the unified buffer)"
            )
    return report


def launched_kernels(
    path: Path, declared: list[tuple[str, TunedKernel]]
) -> list[tuple[str, str, TunedKernel | None]]:
    """(label, op, the kernel as launched) for every launch recorded by ``tests/ascend/record_launches.py``
    (the constexprs and dtypes the models really launch): the one-variant, one-config kernel
    ``TunedKernel.launched`` gives, or None where no declaration names the launch."""
    by_name = {(module, tuned.name): tuned for module, tuned in declared}
    launches = []
    for entry in json.loads(path.read_text())["launches"]:
        tuned = by_name.get((entry["op"], entry["kernel"]))
        fixed = _assignments(entry["constexprs"])
        label = f"{entry['op']}.{entry['kernel']} launched by {'+'.join(entry['models'])} [{fixed}]"
        launches.append(
            (label, entry["op"], tuned and tuned.launched(entry["signature"], entry["constexprs"]))
        )
    return launches


# What the workers of ``_check_all`` lower, and with what: set before they fork, so that only the
# reports are pickled (JIT functions are not).
_WORK: dict[str, Any] = {}


def _check_job(index: int) -> Report:
    label, module, tuned, sweep = _WORK["jobs"][index]
    if tuned is None:
        return Report(label, module, (), [f"{label}: no declaration in KERNELS names it"])
    report = check(tuned, module, _WORK["known"], _WORK["targets"], sweep, _WORK["plan_cache"])
    report.label = label
    return report


def _check_all(
    jobs: list[tuple[str, str, TunedKernel | None, bool]],
    known: dict[str, JITFunction],
    targets: tuple[tuple[str, GPUTarget, dict[str, Any]], ...],
    plan_cache: Path | None,
) -> list[Report]:
    """``check`` of every job, on one process per core (each lowering and BiSheng run is single-threaded)."""
    _WORK.update(jobs=jobs, known=known, targets=targets, plan_cache=plan_cache)
    workers = min(len(jobs), os.cpu_count() or 1)
    if workers <= 1:
        return [_check_job(i) for i in range(len(jobs))]
    # The kernels with the most lowerings first, so that no long one starts last and runs alone.
    order = sorted(range(len(jobs)), key=lambda i: -_lowerings(jobs[i][2]))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        done = dict(zip(order, pool.map(_check_job, order), strict=True))
    return [done[i] for i in range(len(jobs))]


def _lowerings(tuned: TunedKernel | None) -> int:
    if tuned is None:
        return 0
    return len(tuned.configs) * sum(len(variant.signatures) for variant in tuned.variants)


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def _print(report: Report) -> None:
    modes = "+".join(sorted(report.mix_modes)) or "-"
    print(f"{report.verdict}  {report.label}  mix_mode={modes}  {report.where}")
    for index, config in enumerate(report.configs):
        params = _assignments(config.params, " ")
        estimate = _kib(report.estimates[index]) if index in report.estimates else "-"
        flag = "  ! IR buffers exceed the declared footprint" if report.over_declared(index) else ""
        flag += "  OVER 80 % OF UB" if report.over_budget(index) else ""
        if (plan := report.plans.get(index)) is not None and plan.dropped and plan.error is None:
            flag += f"  BiSheng dropped {' and '.join(plan.dropped)} to fit"
        planned = _plan(report.plans.get(index))
        print(
            f"      {params:<32} IR static buffers {estimate:>10}   BiSheng {planned:>14}"
            f"   declared {_kib(config.ub_bytes):>10} (resident {_kib(config.resident_bytes)}){flag}"
        )
    if report.fallbacks:
        print(
            "      scalar fallbacks (TTIR ops): " + ", ".join(f"{k} {n}" for k, n in report.fallbacks.items())
        )
    if report.dropped:
        marked = len(report.dropped) - len(report.unproven)
        print(f"      dropped masks: {len(report.dropped)} site(s), {marked} marked in bounds")
    if report.errors:
        more = f"   (+{len(report.errors) - 1} more)" if len(report.errors) > 1 else ""
        print(f"      first error: {report.errors[0]}{more}")
    if report.bisheng_error and report.bisheng_error != report.errors[0]:
        print(f"      first BiSheng error: {report.bisheng_error}")


def _plan(plan: bisheng.Plan | None) -> str:
    """A config's BiSheng column: the UB it plans, or FAIL with the UB it required if it said."""
    if plan is None:
        return "-"
    if plan.error is not None:
        return f"FAIL {_kib(plan.ub_bytes)}" if plan.ub_bytes else "FAIL"
    return _kib(plan.ub_bytes)


def _print_table(reports: list[Report]) -> None:
    print("| kernel | config | IR estimate | BiSheng's plan |\n| --- | --- | ---: | ---: |")
    for report in reports:
        for index, config in enumerate(report.configs):
            estimate = _kib(report.estimates[index]) if index in report.estimates else "-"
            plan = report.plans.get(index)
            if plan and plan.dropped and not plan.error:
                planned = f"{_plan(plan)} (without {' and '.join(plan.dropped)})"
            else:
                planned = _plan(plan)
            params = _assignments(config.params, " ") or "-"
            print(f"| `{report.label}` | `{params}` | {estimate} | {planned} |")


def _discover(paths: list[str]) -> tuple[list[tuple[str, TunedKernel]], dict[JITFunction, str], list[str]]:
    """The declared kernels (the op registry's, or the ``KERNELS`` of the module files given), every @jit
    function the scanned modules define (with its module), and the modules that failed."""
    declaring: dict[str, ModuleType] = {}
    defined: dict[JITFunction, str] = {}
    broken: list[str] = []
    for name, module in _modules(paths):
        if isinstance(module, Exception):
            print(f"FAIL  import {name}: {type(module).__name__}: {module}")
            broken.append(name)
            continue
        if getattr(module, "KERNELS", ()):
            declaring[name] = module
        for obj in vars(module).values():
            if (fn := _jit(obj)) is not None and fn.fn.__module__ == module.__name__:
                defined[fn] = name
    if paths:
        return (
            [(name, spec) for name, module in declaring.items() for spec in module.KERNELS],
            defined,
            broken,
        )
    registry = sys.modules.get("triton_kernels.ops")  # absent when it failed to import, reported above
    if registry is None:
        return [], defined, broken
    for name in sorted(declaring.keys() - registry.OPS.keys()):
        print(f"FAIL  {name}: declares KERNELS, but triton_kernels.ops.OPS does not list it")
        broken.append(name)
    return registry.declared_kernels(), defined, broken


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--module",
        action="append",
        default=[],
        metavar="PATH",
        help="check this module file instead of the triton_kernels package (repeatable)",
    )
    parser.add_argument(
        "--targets",
        default="a2,a3",
        help="comma-separated targets: a2, a3 (one lowering covers both) and 950 (default a2,a3)",
    )
    parser.add_argument(
        "--bisheng-cache",
        type=Path,
        default=Path(sys.prefix, "bisheng-cache"),
        metavar="DIR",
        help="BiSheng's results per (module, options, compiler version); default: in the gate's venv",
    )
    parser.add_argument(
        "--table", action="store_true", help="also print docs/ascend-gate.md's table of the UB per config"
    )
    parser.add_argument(
        "--launches",
        default="tests/ascend/launches.json",
        metavar="PATH",
        help="launches recorded by tests/ascend/record_launches.py, lowered too (not with --module)",
    )
    args = parser.parse_args(argv)
    wanted = set(args.targets.split(","))
    if unknown := wanted - {"a2", "a3", "950"}:
        parser.error(f"--targets: {sorted(unknown)} unknown, expected a2, a3 or 950")
    targets = tuple(t for t in TARGETS if wanted & ({"950"} if t[0] == "950" else {"a2", "a3"}))
    start = time.perf_counter()
    specs, defined, failed = _discover(args.module)
    # A @jit function is covered when a declaration names it or a covered function uses it.
    covered: set[JITFunction] = set()
    pending = [tuned.kernel for _, tuned in specs]
    while pending:
        if (fn := pending.pop()) not in covered:
            covered.add(fn)
            pending += _referenced(fn)
    known = {fn.src: fn for fn in covered | set(defined)}
    imported = time.perf_counter()
    jobs = [(f"{name}.{tuned.name}", name, tuned, True) for name, tuned in specs]
    launched = [] if args.module else launched_kernels(Path(args.launches), specs)
    declared = len(jobs)
    jobs += [(label, op, tuned, False) for label, op, tuned in launched]
    checked = _check_all(jobs, known, targets, args.bisheng_cache)
    reports, launches = checked[:declared], checked[declared:]
    for report in reports:
        _print(report)
    for report in launches:
        modes = "+".join(sorted(report.mix_modes)) or "-"
        print(f"{report.verdict}  {report.label}  mix_mode={modes}  BiSheng {_plan(report.plans.get(0))}")
        if report.errors:
            print(f"      first error: {report.errors[0]}")
    failed += [r.label for r in launches if r.errors]
    for fn, name in defined.items():
        if fn not in covered:
            print(
                f"FAIL  {name}.{fn.__name__}: {_where(fn)}: @triton.jit function in no KERNELS entry, and no"
                " declared kernel uses it"
            )
            failed.append(fn.__name__)
    failed += [r.label for r in reports if r.errors]
    if not specs:
        print("FAIL  no KERNELS found: nothing was checked")
        failed.append("discovery")
    if over := sum(r.over_declared(i) for r in reports for i in range(len(r.configs))):
        print(f"note: {over} config(s) marked '!' allocate more static buffers in the IR than they declare")
    passed = sum(not r.errors for r in reports)
    pairs = sum(len(r.configs) for r in reports)
    dropped = {site for r in reports + launches for site in r.dropped}
    unproven = {site for r in reports + launches for site in r.unproven}
    print(
        f"dropped-mask lint: {len(dropped)} masked access(es) lose their mask on Ascend,"
        f" {len(dropped) - len(unproven)} marked in bounds, {len(unproven)} unproven"
    )
    sweeps = sum(r.sweeps for r in reports)
    print(
        f"specialisation sweep: {sum(r.swept for r in reports)} of {sweeps} lowerings with runtime hints"
        f" ({' and '.join(SPECIALISATIONS)}, one per kernel variant) pass"
    )
    budgeted = [(r, i) for r in reports + launches for i in range(len(r.configs)) if i in r.estimates]
    over = [f"{r.label} {r.configs[i].params}" for r, i in budgeted if r.over_budget(i)]
    print(
        f"UB budget: {len(budgeted) - len(over)} of {len(budgeted)} configs estimate at most"
        f" {_kib(UB_BUDGET_BYTES)} (80 % of {_kib(ASCEND_UB_BYTES)}) in the IR"
        + (f"; over it: {'; '.join(over)}" if over else "")
    )
    compiled = reports + launches
    planned = [
        (p.ub_bytes, r.label, r.configs[i]) for r in compiled for i, p in r.plans.items() if not p.error
    ]
    largest = max(planned, default=(0, "-", TuneConfig({}, 0)), key=lambda p: p[0])
    failures = sum(r.compile_failures for r in compiled)
    print(
        f"bisheng: {sum(r.compiled for r in compiled) - failures} of {sum(r.compiled for r in compiled)}"
        f" lowerings through bishengir-compile ({bisheng.version().split(' (')[0]}, up to memory planning),"
        f" {failures} failed, largest planned UB {_kib(largest[0])}"
        f" ({largest[1]} {_assignments(largest[2].params)})"
    )
    if not args.module:
        print(
            f"launched-constexpr coverage: {sum(not r.errors for r in launches)} of {len(launches)} launches"
            f" recorded from the models lower ({args.launches})"
        )
    if args.table:
        _print_table(reports)
    labels = " and ".join(label for label, _, _ in targets)
    print(
        f"{passed} passed, {len(failed)} failed: {pairs} (kernel, config) pairs lowered for {labels}"
        f" ({sum(r.lowerings for r in reports)} lowerings with the dtype variants)"
        f" in {time.perf_counter() - imported:.1f} s (+{imported - start:.1f} s imports)"
    )
    return 1 if failed else 0
