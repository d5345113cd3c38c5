"""Tuned files written per SKU are what the kernels launch with, and a bad one is refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from autotune.sweep import BucketSweep, Trial
from autotune.writer import document, write
from benchmarks.workload import TINY_PHASES, Workload
from model.config import ModelConfig
from model.testing.tiny import toy_config
from triton_kernels import runtime, topk, tuning
from triton_kernels.spec import TuneConfig


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    for task in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
        offs = task * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


_SMALL = TuneConfig({"BLOCK": 16}, 1024)
# 200 KiB resident: inside the 227 KiB of an H200's shared memory, over the 192 KiB of a 910B2's UB.
_LARGE = TuneConfig({"BLOCK": 64}, 100 * 1024)
_copy_tuned = tuning.TunedKernel(_copy_kernel, (_SMALL, _LARGE), key=["n"])


@pytest.fixture(scope="module")
def work() -> Workload:
    return Workload(ModelConfig.from_dict(toy_config("v41")), "tiny v41", TINY_PHASES)


def _write(
    out: Path, sku: str, kernel: tuning.TunedKernel, bucket: str, chosen: TuneConfig, work: Workload
) -> Path:
    """A file for ``sku`` as a sweep that found ``chosen`` fastest in ``bucket`` writes it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DSV4_SKU", sku)
        trials = [Trial(c, 1.0 if c == chosen else 2.0) for c in kernel.configs]
        return write(out, document(kernel.op, [BucketSweep(kernel, bucket, trials)], work))


def _copy(n: int = 100) -> list[TuneConfig]:
    src = torch.arange(n, dtype=torch.float32)
    dst = torch.zeros_like(src)
    with tuning.recording() as launches:
        _copy_tuned[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](src, dst, n)
    assert torch.equal(dst, src)
    return [launch.config for launch in launches]


def test_each_sku_launches_the_config_of_its_own_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, work: Workload
) -> None:
    small, large = topk.KERNELS[0].configs[0], topk.KERNELS[0].configs[-1]
    assert small.params != large.params
    _write(tmp_path, "Ascend910B2", topk._topk_tuned, "K=16", small, work)
    _write(tmp_path, "Ascend910B3", topk._topk_tuned, "K=16", large, work)
    monkeypatch.setenv("DSV4_TUNED_DIR", str(tmp_path))
    scores = torch.randn(3, 300)
    for sku, k, expected in (
        ("Ascend910B3", 16, large),
        ("Ascend910B2", 16, small),
        ("Ascend910B3", 13, large),  # 13 rounds up to the swept bucket K=16
        ("Ascend910B3", 32, topk.KERNELS[0].configs[0]),  # no bucket K=32: the heuristic default
        ("Ascend910B4", 16, topk.KERNELS[0].configs[0]),  # no file for this SKU
    ):
        monkeypatch.setenv("DSV4_SKU", sku)
        with tuning.recording() as launches:
            out = topk.topk_positions_triton(scores, k)
        assert [launch.config for launch in launches] == [expected], (sku, k)
        assert torch.equal(out, topk.topk_positions_ref(scores, k))


def test_a_config_over_the_910b2_budget_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, work: Workload
) -> None:
    _write(tmp_path, "NVIDIA_H200", _copy_tuned, "n=128", _LARGE, work)
    _write(tmp_path, "Ascend910B2", _copy_tuned, "n=128", _LARGE, work)
    monkeypatch.setenv("DSV4_TUNED_DIR", str(tmp_path))
    monkeypatch.setenv("DSV4_SKU", "NVIDIA_H200")
    assert _copy() == [_LARGE]
    monkeypatch.setenv("DSV4_SKU", "Ascend910B2")
    with pytest.raises(
        ValueError, match=r"footprint of 204800 B, over the on-chip budget 196608 B of Ascend910B2"
    ):
        _copy()


def test_a_file_swept_on_other_core_counts_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, work: Workload
) -> None:
    path = _write(tmp_path, "Ascend910B2", _copy_tuned, "n=128", _SMALL, work)
    (tmp_path / "Ascend910B3").mkdir()
    shutil.copy(path, tmp_path / "Ascend910B3" / path.name)
    monkeypatch.setenv("DSV4_TUNED_DIR", str(tmp_path))
    monkeypatch.setenv("DSV4_SKU", "Ascend910B3")
    with pytest.raises(ValueError, match="swept on 24 AI / 48 vector cores, but Ascend910B3 has 20 / 40"):
        _copy()


def test_a_dry_run_is_never_used_on_a_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, work: Workload
) -> None:
    _write(tmp_path, "NVIDIA_H200", _copy_tuned, "n=128", _LARGE, work)  # written on this CPU: a dry run
    monkeypatch.setenv("DSV4_TUNED_DIR", str(tmp_path))
    monkeypatch.setenv("DSV4_SKU", "NVIDIA_H200")
    monkeypatch.setattr(runtime, "backend", lambda: "cuda")
    with pytest.warns(UserWarning, match="a dry run .* ignored on cuda"):
        assert _copy() == [_SMALL]


def test_a_config_the_kernel_does_not_declare_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, work: Workload
) -> None:
    path = _write(tmp_path, "Ascend910B2", _copy_tuned, "n=128", _SMALL, work)
    path.write_text(path.read_text().replace('"BLOCK": 16', '"BLOCK": 32'))
    monkeypatch.setenv("DSV4_TUNED_DIR", str(tmp_path))
    monkeypatch.setenv("DSV4_SKU", "Ascend910B2")
    with pytest.raises(
        ValueError, match=r"_copy_kernel \[n=128\]: chosen config .*'BLOCK': 32.* is not one of"
    ):
        _copy()


def test_the_files_are_checked_at_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, work: Workload
) -> None:
    """``load_tuned_files`` (what the engine calls when it starts) reads every op's file of the SKU and
    fails on a bad one before any kernel launches."""
    path = _write(tmp_path, "Ascend910B2", topk._topk_tuned, "K=16", topk.KERNELS[0].configs[-1], work)
    monkeypatch.setenv("DSV4_TUNED_DIR", str(tmp_path))
    monkeypatch.setenv("DSV4_SKU", "Ascend910B2")
    assert tuning.load_tuned_files() == [path]
    monkeypatch.setenv("DSV4_SKU", "Ascend910B4")
    assert tuning.load_tuned_files() == []  # no file: every kernel takes its heuristic default
    (tmp_path / "Ascend910B3").mkdir()
    shutil.copy(path, tmp_path / "Ascend910B3" / path.name)
    monkeypatch.setenv("DSV4_SKU", "Ascend910B3")
    with pytest.raises(ValueError, match="swept on 24 AI / 48 vector cores, but Ascend910B3 has 20 / 40"):
        tuning.load_tuned_files()
