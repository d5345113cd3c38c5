"""The decode-graphs benchmark runs both sides and reports the same greedy output for them."""

from __future__ import annotations

import re

import pytest

from benchmarks.decode_graphs import main


def test_benchmark_times_both_sides_and_compares_their_outputs(capsys: pytest.CaptureFixture) -> None:
    main(["--arch", "v4", "--requests", "3", "--prompt-len", "5", "--max-tokens", "4", "--device", "cpu"])
    header, row = capsys.readouterr().out.splitlines()
    assert header == "tiny v4: 3 requests x 4 greedy tokens, prompts of 5, cpu float32"
    found = re.fullmatch(
        r"  decode step  eager +([\d.]+) ms  graphs \(cpu\) +([\d.]+) ms  speed-up +([\d.]+)"
        r"  captured in ([\d.]+) s  same output (True|False)",
        row,
    )
    assert found, row
    eager, graphs, speedup, _, same = found.groups()
    assert float(eager) > 0 and float(graphs) > 0
    assert float(speedup) == pytest.approx(float(eager) / float(graphs), abs=0.02)
    assert same == "True"  # the replayed steps decode what the eager ones do


@pytest.mark.parametrize("argv", [["--requests", "0"], ["--prompt-len", "0"], ["--max-tokens", "1"]])
def test_a_run_without_a_decode_step_is_refused(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(argv)
    assert "must be at least" in capsys.readouterr().err
