"""Which config each Triton kernel launches with: the SKU's tuned file, else the first config that fits.

``python -m autotune`` sweeps the configs of every kernel per shape bucket on one SKU and writes
``<tuned_dir()>/<sku>/<op>.json`` (``op``: the op module, e.g. ``topk``). A ``TunedKernel`` picks the
config of each launch without benchmarking (autotuning at the first launch of each shape, as
``triton.autotune`` does, is slow and noisy in production):

1. the config the current SKU's file chose for the launch's bucket, where it has one;
2. otherwise the heuristic default: the first declared config that fits the SKU's on-chip budget.
   Op modules declare their configs in order of preference, the safest (smallest) first.

A file is read once per (directory, SKU, op), by ``load_tuned_files()`` at start-up (the engine calls
it, so that a bad file stops it before any request) or else at the first launch of a kernel of its
op, and checked whole: a file swept on other core counts than the SKU's, naming a kernel or a config
the op does not declare, or choosing a config over the SKU's on-chip budget is refused with
``ValueError``. A dry-run
file (swept under the interpreter on a CPU) is used on the CPU backend only, never on a device.

A bucket is the launch's key arguments, each rounded up to a power of two: ``"H=64,D=128"``.
``DSV4_TUNED_DIR`` overrides the directory (default: ``autotune/configs`` next to this package).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import triton

from triton_kernels import runtime
from triton_kernels.spec import TuneConfig, Variant

FORMAT = 1
_DEFAULT_DIR = Path(__file__).resolve().parents[1] / "autotune" / "configs"
_registry: dict[str, dict[str, TunedKernel]] = {}
_recording: list[Launch] | None = None


def tuned_dir() -> Path:
    return Path(os.environ.get("DSV4_TUNED_DIR") or _DEFAULT_DIR)


def tuned_path(directory: Path, sku: str, op: str) -> Path:
    return directory / sku / f"{op}.json"


def config_id(config: TuneConfig) -> dict[str, Any]:
    """How a tuned file names a config."""
    return {"params": dict(config.params), "multibuffer": config.multibuffer}


def bucket_of(values: dict[str, Any]) -> str:
    rounded = {k: int(v) if int(v) <= 0 else triton.next_power_of_2(int(v)) for k, v in values.items()}
    return ",".join(f"{k}={v}" for k, v in rounded.items())


def kernels(op: str) -> dict[str, TunedKernel]:
    """The tuned kernels an op module declares, by name."""
    return dict(_registry.get(op, {}))


def load_tuned_files() -> list[Path]:
    """Read and check the current SKU's file of every op that declares tuned kernels; the files found."""
    directory, sku = tuned_dir(), runtime.sku()
    for op in _registry:
        _tuned(str(directory), sku, op, runtime.backend())
    return [path for op in _registry if (path := tuned_path(directory, sku, op)).is_file()]


@dataclass(frozen=True)
class Launch:
    kernel: TunedKernel
    bucket: str
    config: TuneConfig
    # Triton types of the non-constexpr arguments ("*bf16", "i32") and the constexpr values (the
    # config's included), as a compiler sees the launch: the Ascend gate lowers what was launched.
    signature: dict[str, str] = field(default_factory=dict)
    constexprs: dict[str, int] = field(default_factory=dict)


_TORCH_TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int8": "i8", "uint8": "u8"}
_TORCH_TYPES.update({"int32": "i32", "int64": "i64", "bool": "i1"})


def _triton_type(value: Any) -> str:
    if hasattr(value, "data_ptr"):
        return "*" + _TORCH_TYPES[str(value.dtype).removeprefix("torch.")]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    return "fp32"


def _as_compiled(kernel: Any, named: dict[str, Any]) -> tuple[dict[str, str], dict[str, int]]:
    """(signature, constexprs) of a launch, in the kernel's parameter order."""
    signature, constexprs = {}, {}
    for param in inspect.signature(kernel.fn).parameters.values():
        if "constexpr" in str(param.annotation):
            constexprs[param.name] = int(named[param.name])
        else:
            signature[param.name] = _triton_type(named[param.name])
    return signature, constexprs


class TunedKernel:
    """The one declaration of a ``@triton.jit`` kernel: what it is compiled for, its autotune space and
    how a launch picks its config. Launchers call ``tuned[tuned.grid(n)](*args, **kwargs)`` (the chosen
    config's constexprs are added, and ``multibuffer`` on the NPU, the only backend that takes it) and get
    the config back; ``python -m autotune`` times it; the Ascend gate lowers it.

    ``key`` names the arguments whose values pick the bucket. ``name`` (default: the kernel's) must be
    unique in the op module: two tuned kernels over one ``@triton.jit`` function need their own.
    ``variants`` are what the gate lowers: the model's fixed constexprs and the argument types launched
    with them. ``uses_cube`` is True for kernels with ``tl.dot``: they launch one program per AI core
    (cube + vector, Ascend ``mix`` mode); the others one per vector core (``aiv``). ``never_one`` names
    integer arguments no valid launch passes as 1 (the gate's "equal to 1" specialisation leaves them
    at 16); batch sizes and counts are ``do_not_specialize`` in the kernel itself.
    """

    def __init__(
        self,
        kernel: Any,
        configs: Sequence[TuneConfig],
        key: Sequence[str] = (),
        name: str = "",
        *,
        variants: Sequence[Variant] = (),
        uses_cube: bool = False,
        never_one: Sequence[str] = (),
        register: bool = True,
    ) -> None:
        self.kernel, self.configs, self.key = kernel, tuple(configs), tuple(key)
        self.variants, self.uses_cube, self.never_one = tuple(variants), uses_cube, tuple(never_one)
        self.op = kernel.fn.__module__.rsplit(".", 1)[-1]
        self.name = name or kernel.fn.__name__
        if not self.configs:
            raise ValueError(f"{self.op}.{self.name}: configs: none declared, at least one is needed")
        if register:
            declared = _registry.setdefault(self.op, {})
            if self.name in declared:
                raise ValueError(f"{self.op}.{self.name}: name: already taken by a tuned kernel of {self.op}")
            declared[self.name] = self
        self._forced: TuneConfig | None = None

    def grid(self, n_tasks: int) -> tuple[int]:
        """Persistent 1-D grid: one program per core of the kind the kernel runs on, never more than tasks."""
        return runtime.grid(n_tasks, self.uses_cube)

    def launched(self, signature: dict[str, str], constexprs: dict[str, int]) -> TunedKernel:
        """This kernel as one recorded launch compiled it (all constexprs fixed), for the gate: with the
        compile options of the declared config the launch ran (its params are among the constexprs)."""
        variant = Variant(constexprs, (signature,))
        ran = [c for c in self.configs if c.params.items() <= constexprs.items()]
        return TunedKernel(
            self.kernel,
            (TuneConfig({}, 0, ran[0].multibuffer if ran else True),),
            self.key,
            self.name,
            variants=(variant,),
            uses_cube=self.uses_cube,
            never_one=self.never_one,
            register=False,
        )

    def __getitem__(self, grid: Any) -> Callable[..., TuneConfig]:
        return functools.partial(self.run, grid)

    def run(self, grid: Any, *args: Any, **kwargs: Any) -> TuneConfig:
        """Launches the kernel; the config it chose."""
        named = {**dict(zip(self.kernel.arg_names[: len(args)], args, strict=True)), **kwargs}
        bucket = bucket_of({k: named[k] for k in self.key})
        config = self._forced or self.choose(bucket)
        if _recording is not None:
            _recording.append(
                Launch(self, bucket, config, *_as_compiled(self.kernel, {**named, **config.params}))
            )
        options = {"multibuffer": config.multibuffer} if runtime.backend() == "npu" else {}
        self.kernel[grid](*args, **kwargs, **config.params, **options)
        return config

    def choose(self, bucket: str) -> TuneConfig:
        chosen = _tuned(str(tuned_dir()), runtime.sku(), self.op, runtime.backend()).get(self.name, {})
        return chosen.get(bucket) or self.default()

    def default(self) -> TuneConfig:
        config = next((c for c in self.configs if runtime.fits(c)), None)
        if config is None:
            smallest = min(c.resident_bytes for c in self.configs)
            raise ValueError(
                f"{self.op}.{self.name}: configs: smallest resident footprint {smallest} B exceeds the"
                f" on-chip budget {runtime.onchip_bytes()} B of {runtime.sku()}"
            )
        return config

    @contextmanager
    def forced(self, config: TuneConfig) -> Iterator[None]:
        """Launches inside the block use ``config``, whatever the file or the default says (sweeps)."""
        self._forced = config
        try:
            yield
        finally:
            self._forced = None


@contextmanager
def recording() -> Iterator[list[Launch]]:
    """Collects the tuned launches made inside the block: a sweep finds a case's kernels with it."""
    global _recording
    outer, _recording = _recording, []
    try:
        yield _recording
    finally:
        _recording = outer


@functools.cache
def _tuned(directory: str, sku: str, op: str, backend: str) -> dict[str, dict[str, TuneConfig]]:
    """Kernel name -> bucket -> the declared config the file of ``sku`` chose; empty without a file."""
    path = tuned_path(Path(directory), sku, op)
    if not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read tuned configs: {e}") from e
    if doc.get("format") != FORMAT:
        raise ValueError(f"{path}: format {doc.get('format')!r} is not {FORMAT}: sweep again")
    if doc.get("dry_run") and backend != "cpu":
        warnings.warn(f"{path}: a dry run (swept on a CPU), ignored on {backend}", stacklevel=2)
        return {}
    profile = runtime.profile()
    swept = (doc.get("aicores"), doc.get("vectorcores"))
    if swept != (profile.aicores, profile.vectorcores):
        raise ValueError(
            f"{path}: swept on {swept[0]} AI / {swept[1]} vector cores, but {sku} has"
            f" {profile.aicores} / {profile.vectorcores}: sweep this SKU again (python -m autotune)"
        )
    declared = _registry.get(op, {})
    chosen: dict[str, dict[str, TuneConfig]] = {}
    for name, buckets in doc.get("kernels", {}).items():
        if name not in declared:
            raise ValueError(f"{path}: kernel {name!r} is not a tuned kernel of {op} ({sorted(declared)})")
        chosen[name] = {
            b: _declared(f"{path}: {name} [{b}]", declared[name], entry.get("chosen"))
            for b, entry in buckets.items()
        }
    return chosen


def _declared(where: str, kernel: TunedKernel, chosen: Any) -> TuneConfig:
    config = next((c for c in kernel.configs if config_id(c) == chosen), None)
    if config is None:
        known = [config_id(c) for c in kernel.configs]
        raise ValueError(f"{where}: chosen config {chosen} is not one of the declared {known}")
    if not runtime.fits(config):
        raise ValueError(
            f"{where}: chosen config {config.params} (multibuffer={config.multibuffer}) has a resident"
            f" footprint of {config.resident_bytes} B, over the on-chip budget {runtime.onchip_bytes()} B"
            f" of {runtime.sku()}"
        )
    return config
