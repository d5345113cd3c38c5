"""Sweep the configs of every tuned kernel a case launches, per shape bucket.

A first run of each case records which tuned kernels it launches and in which buckets
(``tuning.recording``). Then every declared config of each of them is forced in turn and the whole
case timed (the other kernels of the case keep their own configs, the same for every trial). A
bucket's time for a config is the sum over the cases that reach the bucket; a config that does not
fit the SKU's on-chip budget or fails in any case (a compiler refusal, an out-of-resources launch)
is invalid there. The fastest valid config of a bucket is chosen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autotune.progress import Progress
from benchmarks.cases import Case
from benchmarks.common import time_ms
from triton_kernels import runtime, tuning
from triton_kernels.spec import TuneConfig


@dataclass
class Trial:
    config: TuneConfig
    ms: float | None = 0.0  # summed over the bucket's cases; None once invalid
    error: str = ""

    def fail(self, error: str) -> None:
        self.ms, self.error = None, error


@dataclass
class BucketSweep:
    kernel: tuning.TunedKernel
    bucket: str
    trials: list[Trial]
    cases: list[str] = field(default_factory=list)

    @property
    def best(self) -> Trial | None:
        valid = [t for t in self.trials if t.ms is not None]
        return min(valid, key=lambda t: t.ms) if valid else None


def sweep(op: str, cases: list[Case]) -> list[BucketSweep]:
    plans = []
    for case in cases:
        with tuning.recording() as launches:
            case.kernel()
        # The op's own kernels: another op's kernel a case launches on the way is swept with that op.
        own = [(launch.kernel, launch.bucket) for launch in launches if launch.kernel.op == op]
        plans.append((case, list(dict.fromkeys(own))))
    found: dict[tuple[str, str], BucketSweep] = {}
    total = sum(len(kernel.configs) for _, launched in plans for kernel, _ in launched)
    with Progress(total, op) as progress:
        for case, launched in plans:
            for kernel, bucket in launched:
                entry = found.setdefault(
                    (kernel.name, bucket), BucketSweep(kernel, bucket, [Trial(c) for c in kernel.configs])
                )
                entry.cases.append(f"{case.name} ({case.phase})")
                for trial in entry.trials:
                    _time(trial, kernel, case)
                    progress.update()
    return list(found.values())


def _time(trial: Trial, kernel: tuning.TunedKernel, case: Case) -> None:
    if trial.ms is None:
        return
    config = trial.config
    if not runtime.fits(config):
        trial.fail(f"resident {config.resident_bytes} B over the on-chip budget {runtime.onchip_bytes()} B")
        return
    try:
        with kernel.forced(config):
            ms = time_ms(case.kernel, 1)
    # Whatever a config breaks (compilation, resources, launch) makes it invalid, not the sweep.
    except Exception as e:
        trial.fail(f"{type(e).__name__}: {e}"[:500])
    else:
        trial.ms += ms
