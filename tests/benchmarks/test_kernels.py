"""``python -m benchmarks.kernels`` on a CPU, and the roofline arithmetic behind its table."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from benchmarks.cases import OPS, Case, select
from benchmarks.kernels import main
from benchmarks.roofline import Peaks, Row, plot, row
from benchmarks.workload import Phase


def test_quick_run_prints_the_table_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = main(["--quick", "--json", str(tmp_path / "k.json"), "--plot", str(tmp_path / "k.png")])
    out = capsys.readouterr().out
    assert "op / case" in out and "kernel ms" in out and "of peak" in out
    assert {r.op for r in rows} == set(OPS)
    for r in rows:
        assert f"{r.op}: {r.case}" in out
        assert r.kernel_ms > 0 and r.fraction is None  # the interpreter has no peak
    doc = json.loads((tmp_path / "k.json").read_text())
    assert doc["backend"] == "cpu" and doc["interpreter"] and len(doc["rows"]) == len(rows)
    assert "plot skipped: no peak is known" in out and not (tmp_path / "k.png").exists()


def test_ops_are_validated() -> None:
    assert select("topk, indexer") == ["topk", "indexer"]
    with pytest.raises(ValueError, match=r"--ops: 'topk,attention' names unknown ops \['attention'\]"):
        select("topk,attention")


def _case(bytes_: int, flops: int, int8: bool = False) -> Case:
    return Case("op", "case", Phase("decode", 1, 1, 8), lambda: None, lambda: None, bytes_, flops, int8)


def test_fraction_is_of_the_binding_roof() -> None:
    peaks = Peaks(hbm=1e12, bf16=100e12, int8=200e12)
    memory = row(_case(bytes_=10**9, flops=10**9), torch_ms=2.0, kernel_ms=2.0, peaks=peaks)
    assert (memory.gb_per_s, memory.bound, memory.fraction) == (500.0, "memory", pytest.approx(0.5))
    compute = row(_case(bytes_=10**6, flops=10**11), torch_ms=2.0, kernel_ms=2.0, peaks=peaks)
    assert (compute.tflop_per_s, compute.bound, compute.fraction) == (50.0, "compute", pytest.approx(0.5))
    int8 = row(_case(bytes_=10**6, flops=10**11, int8=True), torch_ms=2.0, kernel_ms=2.0, peaks=peaks)
    assert int8.fraction == pytest.approx(0.25)
    unknown = row(_case(10**9, 10**9), 1.0, 1.0, Peaks(None, None, None))
    assert (unknown.bound, unknown.fraction) == ("-", None)


def test_plot_of_fractions(tmp_path: Path) -> None:
    """A PNG where matplotlib is installed (the ``bench`` extra), else a message saying it was skipped."""
    rows = [
        Row("op", f"case {i}", "decode 1x1 ctx 8", 1.0, 1.0, 1.0, 1.0, "memory", 0.1 * i) for i in range(3)
    ]
    path = tmp_path / "p.png"
    message = plot(rows, str(path))
    if importlib.util.find_spec("matplotlib") is None:
        assert message == f"plot skipped: matplotlib is not installed ({path} not written)"
        assert not path.exists()
    else:
        assert message == f"plot written to {path}" and path.stat().st_size > 0
    unplaced = [Row("op", "case", "decode", 1.0, 1.0, 1.0, 1.0, "-", None)]
    assert plot(unplaced, str(path)).startswith("plot skipped: no peak is known")
