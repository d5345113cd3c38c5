"""A case's place on the roofline: achieved GB/s and TFLOP/s, and the fraction of the binding roof.

The fraction is of the roofline at the case's arithmetic intensity, ``min(peak, bandwidth · I)``,
which equals the larger of the bandwidth fraction and the compute fraction: the binding roof is the
``bound``. Bandwidth is measured by a device copy; compute peaks come from the runtime's SKU profile
(int8 cases against the int8 peak).
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.cases import Case


@dataclass(frozen=True)
class Peaks:
    hbm: float | None  # bytes/s, measured
    bf16: float | None  # FLOP/s
    int8: float | None  # op/s


@dataclass(frozen=True)
class Row:
    op: str
    case: str
    phase: str
    torch_ms: float
    kernel_ms: float
    gb_per_s: float
    tflop_per_s: float
    bound: str  # "memory", "compute", or "-" without peaks
    fraction: float | None  # of the binding roof

    @property
    def label(self) -> str:
        return f"{self.op}: {self.case} ({self.phase})"


def row(case: Case, torch_ms: float, kernel_ms: float, peaks: Peaks) -> Row:
    seconds = kernel_ms * 1e-3
    rate, flops = case.bytes / seconds, case.flops / seconds
    compute_peak = peaks.int8 if case.int8 else peaks.bf16
    fractions = {
        "memory": rate / peaks.hbm if peaks.hbm else None,
        "compute": flops / compute_peak if compute_peak and case.flops else None,
    }
    known = {bound: f for bound, f in fractions.items() if f is not None}
    bound, fraction = max(known.items(), key=lambda kv: kv[1]) if known else ("-", None)
    return Row(
        case.op, case.name, str(case.phase), torch_ms, kernel_ms, rate / 1e9, flops / 1e12, bound, fraction
    )


_HEADER = f"{'op / case':<44}{'phase':<26}{'torch ms':>10}{'kernel ms':>11}{'GB/s':>9}{'TFLOP/s':>9}"
_HEADER += "  bound    of peak"


def table(rows: list[Row]) -> str:
    lines = [_HEADER]
    for r in rows:
        fraction = f"{r.fraction:>7.1%}" if r.fraction is not None else f"{'-':>7}"
        lines.append(
            f"{r.op + ': ' + r.case:<44}{r.phase:<26}{r.torch_ms:>10.3f}{r.kernel_ms:>11.3f}"
            f"{r.gb_per_s:>9.1f}{r.tflop_per_s:>9.2f}  {r.bound:<8}{fraction}"
        )
    return "\n".join(lines)


def plot(rows: list[Row], path: str) -> str:
    """Writes a bar chart of every case's fraction of peak to ``path``; says what it did."""
    placed = [r for r in rows if r.fraction is not None]
    if not placed:
        return f"plot skipped: no peak is known for this device, so no fraction of it ({path} not written)"
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return f"plot skipped: matplotlib is not installed ({path} not written)"
    fig, ax = plt.subplots(figsize=(9, 0.3 * len(placed) + 1.5))
    colors = {"memory": "tab:blue", "compute": "tab:orange"}
    fractions = [100 * r.fraction for r in placed]
    ax.barh([r.label for r in placed], fractions, color=[colors[r.bound] for r in placed])
    for goal, bound in ((60, "memory"), (40, "compute")):
        ax.axvline(goal, color=colors[bound], linestyle="--", linewidth=1)
    ax.set_title("memory-bound (blue, goal 60%) and compute-bound (orange, goal 40%)", fontsize="small")
    ax.set_xlabel("% of the binding roof (HBM copy bandwidth or peak compute)")
    ax.set_xlim(0, max(100, *fractions))
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot written to {path}"
