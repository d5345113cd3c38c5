"""Proves the Ascend gate can fail: run on bad_kernels.py it must exit 1, pass none of its kernels and
name each ``# gate:`` line with the text marked there, BiSheng's UB overflow among them.

Runs in the triton-ascend venv (``.ci/ascend_gate.sh``), not under pytest: the main test venv has upstream
triton, which cannot lower for Ascend.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UB_OVERFLOW = "ub overflow"  # only BiSheng's memory planning says it
BAD = Path(__file__).resolve().with_name("bad_kernels.py").relative_to(ROOT)


def main() -> int:
    marks = [
        (number, match[1])
        for number, line in enumerate((ROOT / BAD).read_text().splitlines(), 1)
        if (match := re.search(r"# gate: (.+)$", line))
    ]
    run = subprocess.run(
        [sys.executable, "-m", "ascend_gate", "--module", str(BAD)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    # Indented so the gate's own "0 passed, N failed" summary is not mistaken for the CI verdict.
    print("\n".join(f"  | {line}" for line in (run.stdout + run.stderr).splitlines()))
    problems = [f"exit status {run.returncode}, expected 1"] if run.returncode != 1 else []
    if not any(UB_OVERFLOW in text for _, text in marks):
        problems.append(f"no kernel marked '{UB_OVERFLOW}': nothing shows BiSheng's memory planning fails")
    if not re.search(r"^0 passed, \d+ failed", run.stdout, re.M):
        problems.append("some kernel of bad_kernels.py passed the gate")
    for number, text in marks:
        if not re.search(rf"{re.escape(f'{BAD}:{number}:')}.*{re.escape(text)}", run.stdout):
            problems.append(f"no failure naming {BAD}:{number} with {text!r}")
    for problem in problems:
        print(f"negative check: {problem}", file=sys.stderr)
    print(
        "negative check:",
        "FAILED" if problems else f"OK, the gate fails every bad kernel at its {len(marks)} marked lines",
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
