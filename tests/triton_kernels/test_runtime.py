from __future__ import annotations

import inspect
import os
import re
from types import ModuleType, SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl

from triton_kernels import compressor, engram, indexer, mhc, quant, rmsnorm, rope, runtime, sparse_attn, topk
from triton_kernels.spec import KernelSpec, TuneConfig

OP_MODULES = (rmsnorm, rope, mhc, topk, indexer, quant, sparse_attn, compressor, engram)


def test_cpu_backend_facts() -> None:
    assert runtime.backend() == "cpu"
    assert runtime.device_name() == "cpu"
    assert runtime.num_aicore() == min(4, os.cpu_count() or 1)
    assert runtime.num_vectorcore() == runtime.num_aicore()
    assert runtime.onchip_bytes() == runtime.ASCEND_UB_BYTES == 192 * 1024


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
    cube = KernelSpec(_copy_kernel, signatures=(), configs=(), uses_cube=True)
    vector = KernelSpec(_copy_kernel, signatures=(), configs=())
    assert runtime.grid(cube, 1000) == (24,)
    assert runtime.grid(vector, 1000) == (48,)
    assert runtime.grid(vector, 5) == (5,)
    assert runtime.grid(vector, 0) == (1,)


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    for task in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
        offs = task * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


def test_autotune_drops_configs_over_budget_and_picks_one() -> None:
    configs = (
        TuneConfig({"BLOCK": 16}, 64),
        TuneConfig({"BLOCK": 64}, 256),
        TuneConfig({"BLOCK": 1 << 20}, runtime.ASCEND_UB_BYTES),  # fits only single-buffered: dropped
    )
    tuned = runtime.autotune(configs, key=["n"])(_copy_kernel)
    assert [c.kwargs for c in tuned.configs] == [{"BLOCK": 16}, {"BLOCK": 64}]
    src = torch.arange(100, dtype=torch.float32)
    dst = torch.zeros_like(src)
    tuned[lambda meta: (triton.cdiv(100, meta["BLOCK"]),)](src, dst, 100)
    assert torch.equal(dst, src)
    assert len(tuned.configs_timings) == 2
    assert tuned.best_config.kwargs in ({"BLOCK": 16}, {"BLOCK": 64})


def test_autotune_rejects_a_space_that_never_fits() -> None:
    with pytest.raises(ValueError, match="configs: .* exceeds budget"):
        runtime.autotune((TuneConfig({"BLOCK": 16}, runtime.ASCEND_UB_BYTES),), key=["n"])


def test_autotune_passes_multibuffer_only_on_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    configs = (TuneConfig({"BLOCK": 16}, 64, multibuffer=False),)
    assert runtime.autotune(configs, key=["n"])(_copy_kernel).configs[0].kwargs == {"BLOCK": 16}
    monkeypatch.setattr(runtime, "backend", lambda: "npu")
    on_npu = runtime.autotune(configs, key=["n"])(_copy_kernel)
    assert on_npu.configs[0].kwargs == {"BLOCK": 16, "multibuffer": False}


def test_timer_bench_answers_quantiles() -> None:
    assert len(runtime._timer_bench(lambda: None, quantiles=(0.5, 0.2, 0.8))) == 3
    assert isinstance(runtime._timer_bench(lambda: None), float)


def _jit_functions(module: ModuleType) -> dict[str, str]:
    # A jitted kernel wraps a plain function in `.fn`; an autotuner wraps the jitted kernel.
    return {
        name: inspect.getsource(obj.fn)
        for name, obj in vars(module).items()
        if hasattr(obj, "fn") and inspect.isfunction(obj.fn) and obj.fn.__module__ == module.__name__
    }


@pytest.mark.parametrize("module", OP_MODULES, ids=lambda m: m.__name__)
def test_kernel_specs_describe_every_kernel(module: ModuleType) -> None:
    specs: tuple[KernelSpec, ...] = module.KERNELS
    jitted = _jit_functions(module)
    declared = {spec.name for spec in specs}
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
    for spec in specs:
        params = inspect.signature(spec.kernel.fn).parameters
        constexprs = {p for p in params if "constexpr" in str(params[p].annotation)}
        runtime_args = [p for p in params if p not in constexprs]
        assert spec.signatures and spec.configs
        for signature in spec.signatures:
            assert list(signature) == runtime_args
        for config in spec.configs:
            assert set(config.params) | set(spec.constexprs) == constexprs
            assert runtime.fits(config), (spec.name, config)
