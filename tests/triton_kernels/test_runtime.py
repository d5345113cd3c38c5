from __future__ import annotations

import inspect
import os
import re
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl

from triton_kernels import (
    ops,
    runtime,
    sku,
    tuning,
)
from triton_kernels.spec import TuneConfig

OP_MODULES = tuple(ops.OPS.values())


def test_the_registry_lists_every_op_module() -> None:
    """Every module of the package that declares kernels is an op of the registry, under its name."""
    package = Path(ops.__file__).parent
    declaring = {p.stem for p in package.glob("*.py") if re.search(r"^KERNELS\b", p.read_text(), re.M)}
    assert declaring == set(ops.OPS)
    assert all(name == module.__name__.rpartition(".")[2] for name, module in ops.OPS.items())


def test_cpu_backend_facts() -> None:
    assert runtime.backend() == "cpu"
    assert runtime.device_name() == "cpu"
    assert runtime.num_aicore() == min(4, os.cpu_count() or 1)
    assert runtime.num_vectorcore() == runtime.num_aicore()
    assert runtime.onchip_bytes() == runtime.ASCEND_UB_BYTES == 192 * 1024
    assert runtime.sku() == "cpu" and runtime.profile() is sku.CPU


def test_sku_override_switches_the_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSV4_SKU", "Ascend910B3")
    assert runtime.sku() == "Ascend910B3"
    assert (runtime.num_aicore(), runtime.num_vectorcore(), runtime.onchip_bytes()) == (20, 40, 192 * 1024)
    monkeypatch.setenv("DSV4_SKU", "Ascend910_9392")  # an A3 die
    assert (runtime.profile().name, runtime.num_aicore(), runtime.num_vectorcore()) == (
        "Ascend910_93",
        24,
        48,
    )
    monkeypatch.setenv("DSV4_SKU", "NVIDIA H100 80GB HBM3")
    assert runtime.sku() == "NVIDIA_H100_80GB_HBM3" and runtime.profile().bf16_flops == 989e12
    monkeypatch.setenv("DSV4_SKU", "Ascend310P")
    with pytest.raises(ValueError, match="DSV4_SKU: 'Ascend310P' matches no SKU profile"):
        runtime.num_aicore()


@pytest.mark.parametrize("profile", sku.PROFILES, ids=lambda p: p.name)
def test_persistent_grids_never_exceed_the_profile_cores(
    profile: sku.SkuProfile, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DSV4_SKU", profile.name)
    for module in OP_MODULES:
        for tuned in module.KERNELS:
            cores = profile.aicores if tuned.uses_cube else profile.vectorcores
            assert tuned.grid(10**6) == (cores,)
            assert tuned.grid(3) == (min(3, cores),)


def test_interpreter_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    assert runtime.interpreter_active()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not runtime.interpreter_active()


def test_use_triton_only_on_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    on_gpu = SimpleNamespace(device=torch.device("cuda", 0))
    assert not runtime.use_triton(torch.zeros(2))
    assert runtime.use_triton(on_gpu)
    monkeypatch.setenv("DSV4_FORCE_TORCH", "1")
    assert not runtime.use_triton(on_gpu)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSV4_TRITON_ON_CPU", "1")
    assert runtime.use_triton(torch.zeros(2))
    monkeypatch.setenv("DSV4_FORCE_TORCH", "1")
    assert not runtime.use_triton(torch.zeros(2))
    monkeypatch.setenv("DSV4_FORCE_TORCH", "0")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # compiled kernels cannot take CPU tensors
    assert not runtime.use_triton(torch.zeros(2))


def test_fits_counts_double_buffering() -> None:
    half = runtime.ASCEND_UB_BYTES // 2
    assert runtime.fits(TuneConfig({}, half))
    assert not runtime.fits(TuneConfig({}, half + 1))
    assert runtime.fits(TuneConfig({}, half + 1, multibuffer=False))
    assert not runtime.fits(TuneConfig({}, runtime.ASCEND_UB_BYTES + 1, multibuffer=False))


def test_grid_is_persistent_per_core_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "num_aicore", lambda: 24)
    monkeypatch.setattr(runtime, "num_vectorcore", lambda: 48)
    assert runtime.grid(1000, uses_cube=True) == (24,)
    assert runtime.grid(1000, uses_cube=False) == (48,)
    assert runtime.grid(5, uses_cube=False) == (5,)
    assert runtime.grid(0, uses_cube=False) == (1,)


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    for task in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
        offs = task * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


_SMALL, _BIG = TuneConfig({"BLOCK": 16}, 64), TuneConfig({"BLOCK": 64}, 256)
# Resident only when single-buffered: 192 KiB on the Ascend budget, so never fits doubled.
_TOO_BIG = TuneConfig({"BLOCK": 1 << 20}, runtime.ASCEND_UB_BYTES)


def test_tuned_kernel_without_file_launches_the_first_config_that_fits(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DSV4_TUNED_DIR", str(tmp_path))
    tuned = tuning.TunedKernel(_copy_kernel, (_TOO_BIG, _BIG, _SMALL), key=["n"], name="default")
    src = torch.arange(100, dtype=torch.float32)
    dst = torch.zeros_like(src)
    chosen = tuned[lambda meta: (triton.cdiv(100, meta["BLOCK"]),)](src, dst, 100)
    assert torch.equal(dst, src)
    assert chosen == _BIG
    assert tuned.op == "test_runtime" and tuning.kernels("test_runtime")["default"] is tuned


def test_tuned_kernel_refuses_a_space_that_never_fits(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DSV4_TUNED_DIR", str(tmp_path))
    tuned = tuning.TunedKernel(_copy_kernel, (_TOO_BIG,), key=["n"], name="never_fits")
    src = torch.zeros(4)
    with pytest.raises(ValueError, match="footprint 393216 B exceeds the on-chip budget 196608 B of cpu"):
        tuned[(1,)](src, src, 4)


def test_tuned_kernel_names_are_unique_per_op() -> None:
    tuning.TunedKernel(_copy_kernel, (_SMALL,), key=["n"], name="twice")
    with pytest.raises(ValueError, match="name: already taken"):
        tuning.TunedKernel(_copy_kernel, (_SMALL,), key=["n"], name="twice")


def test_tuned_kernel_passes_multibuffer_only_on_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    launched: list[dict[str, object]] = []

    class Kernel:  # stands in for a JITFunction: records what a launch passes
        fn, arg_names = _copy_kernel.fn, _copy_kernel.arg_names

        def __getitem__(self, grid: object):
            return lambda *args, **kwargs: launched.append(kwargs)

    tuned = tuning.TunedKernel(Kernel(), (TuneConfig({"BLOCK": 16}, 64, multibuffer=False),), ["n"], "mb")
    tuned[(1,)](None, None, 4)
    monkeypatch.setattr(runtime, "backend", lambda: "npu")
    tuned[(1,)](None, None, 4)
    assert launched == [{"BLOCK": 16}, {"BLOCK": 16, "multibuffer": False}]


def test_a_recorded_launch_compiles_with_its_configs_options() -> None:
    """The gate lowers a recorded launch as it ran: single-buffered where the config it ran was."""
    single = TuneConfig({"BLOCK": 32}, 64, multibuffer=False)
    tuned = tuning.TunedKernel(_copy_kernel, (_SMALL, single), ["n"], "recorded", register=False)
    signature = {"src_ptr": "*fp32", "dst_ptr": "*fp32", "n": "i32"}
    ran = {32: False, 16: True, 8: True}  # 8: no declared config (a forced one) keeps the default
    for block, multibuffer in ran.items():
        (config,) = tuned.launched(signature, {"BLOCK": block}).configs
        assert config.multibuffer is multibuffer and config.params == {}


def test_buckets_round_key_values_up_to_powers_of_two() -> None:
    assert (
        tuning.bucket_of({"T": 3, "H": 64, "D": 448, "MODE": 0, "HEAD": True})
        == "T=4,H=64,D=512,MODE=0,HEAD=1"
    )


def _jit_functions(module: ModuleType) -> dict[str, str]:
    # A jitted kernel wraps a plain function in `.fn`; an autotuner wraps the jitted kernel.
    return {
        name: inspect.getsource(obj.fn)
        for name, obj in vars(module).items()
        if hasattr(obj, "fn") and inspect.isfunction(obj.fn) and obj.fn.__module__ == module.__name__
    }


@pytest.mark.parametrize("module", OP_MODULES, ids=lambda m: m.__name__)
def test_kernel_specs_describe_every_kernel(module: ModuleType) -> None:
    declarations: tuple[tuning.TunedKernel, ...] = module.KERNELS
    assert declarations and set(declarations) == set(
        tuning.kernels(module.__name__.rsplit(".", 1)[-1]).values()
    )
    jitted = _jit_functions(module)
    declared = {tuned.kernel.fn.__name__ for tuned in declarations}
    assert declared <= set(jitted)
    # The other @jit functions are helpers: a declared kernel calls each, directly or through helpers.
    reached, sources = set(declared), [jitted[name] for name in declared]
    while sources:
        src = sources.pop()
        for name in set(jitted) - reached:
            if re.search(rf"\b{name}\(", src):
                reached.add(name)
                sources.append(jitted[name])
    assert reached == set(jitted)
    for tuned in declarations:
        params = inspect.signature(tuned.kernel.fn).parameters
        constexprs = {p for p in params if "constexpr" in str(params[p].annotation)}
        runtime_args = [p for p in params if p not in constexprs]
        assert tuned.variants and tuned.configs
        for variant in tuned.variants:
            assert variant.signatures
            for signature in variant.signatures:
                assert list(signature) == runtime_args
            for config in tuned.configs:
                assert set(config.params) | set(variant.constexprs) == constexprs
                assert runtime.fits(config), (tuned.name, config)
