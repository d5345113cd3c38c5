"""Progress of a sweep on stderr: a tqdm bar when tqdm is installed, else one rewritten line."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any


class Progress:
    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.done = total, desc, 0
        try:
            from tqdm import tqdm
        except ImportError:
            self._bar: Any = None
            self._line()
        else:
            self._bar = tqdm(total=total, desc=desc, unit="run", file=sys.stderr)

    def update(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update()
        else:
            self._line()

    def _line(self) -> None:
        sys.stderr.write(f"\r{self.desc}: {self.done}/{self.total} runs")
        sys.stderr.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            sys.stderr.write("\n")
