"""Every interpreter test of the kernels also checks the lanes of the accesses marked in bounds."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.triton_kernels.bounds import PACKAGE, BoundsCheck, marked_lines

_MARKED = marked_lines(sorted(PACKAGE.glob("*.py")))
_HITS: Counter[tuple[str, int]] = Counter()  # over the session, for the summary


@pytest.fixture(autouse=True)
def bounds_check(monkeypatch: pytest.MonkeyPatch) -> BoundsCheck:
    check = BoundsCheck(_MARKED, hits=_HITS)
    check.install(monkeypatch)
    return check


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _HITS:
        return
    missed = sorted(f"{PACKAGE.name}/{path.rsplit('/', 1)[-1]}:{line}" for path, line in _MARKED - set(_HITS))
    terminalreporter.write_line(
        f"in-bounds check: {len(_MARKED) - len(missed)} of {len(_MARKED)} marked accesses ran, every lane"
        f" inside its launch's tensors{'; not run: ' + ', '.join(missed) if missed else ''}"
    )
