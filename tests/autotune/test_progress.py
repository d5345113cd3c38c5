from __future__ import annotations

import sys

import pytest

from autotune.progress import Progress


def test_without_tqdm_progress_is_one_line_on_stderr(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # importing it now raises ImportError
    with Progress(2, "topk") as progress:
        progress.update()
        progress.update()
    err = capsys.readouterr().err
    assert err.endswith("\rtopk: 2/2 runs\n") and "topk: 0/2 runs" in err
