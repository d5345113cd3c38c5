"""The speculative-decoding benchmark runs and reports what it measured."""

from __future__ import annotations

import pytest

from benchmarks.spec_decode import METHODS, main


@pytest.mark.parametrize("arch", sorted(METHODS))
def test_benchmark_prints_tokens_per_pass_for_each_proposer(arch: str, capsys: pytest.CaptureFixture) -> None:
    main(["--arch", arch, "--requests", "2", "--prompt-len", "8", "--max-tokens", "9", "--k", "2"])
    rows = {line[:24].strip(): line[24:].split() for line in capsys.readouterr().out.splitlines()[2:]}
    assert set(rows) == {"no drafts", "forced accept, k=2", f"{METHODS[arch]}, k=2"}
    assert all(cells[-1] == "True" for cells in rows.values())  # same output as without drafts
    assert float(rows["no drafts"][0]) == 1.0
    # Per request: the prompt pass emits 1 token, then passes of 3, 3 and 2: 9 tokens in 4 passes.
    assert float(rows["forced accept, k=2"][0]) == pytest.approx(9 / 4)
