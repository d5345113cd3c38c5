"""A decode step launches as many operators for 8 requests as for 2: the forward runs each op once per layer
on the whole flat batch, with no per-request loop. (One request may launch fewer: a reshape of a single
row is a view where a batch needs a copy.)

What is counted: every aten operator dispatched inside ``batch_forward`` during one decode step on the CPU
path (the torch references, the production path on CPU), except views (no launch on a device). The
requests' prompt lengths differ but are all 1 mod 4 and below 127, so that the decode token closes no
ratio-4 or ratio-128 window of any of them, and a ratio-2 or ratio-1 window of all of them: which
windows close is the same in every batch. The routed experts are left out: ``moe_gemm``'s CPU reference
walks the experts that got tokens, as many GEMMs as distinct experts are hit (its kernels launch a fixed
number, two, on a device).
"""

from __future__ import annotations

import traceback
from collections import Counter

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from tests.engine.test_decode_step import decoding, watching
from triton_kernels import runtime

LENGTHS = (5, 29, 13, 21, 9, 33, 17, 25)


class Launches(TorchDispatchMode):
    """Every non-view aten operator dispatched while ``active``, by name, outside the MoE."""

    def __init__(self) -> None:
        super().__init__()
        self.active, self.ops = False, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.active and not func.is_view:
            if not any(f.filename.endswith("model/moe.py") for f in traceback.extract_stack()):
                self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def launches_per_step(arch: str, lengths: tuple[int, ...]) -> Counter:
    engine = decoding(arch, lengths)
    model, hook = engine.runner.model, Launches()
    model.batch_forward = watching(hook, model.batch_forward)
    with hook:
        done = engine.step()
    assert len(done) == engine.step_tokens == len(lengths)  # one decode token of every request
    return hook.ops


@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_decode_step_launches_do_not_grow_with_the_requests(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runtime, "check_ranges", lambda: False)  # a debug switch, off in production
    counts = {n: launches_per_step(arch, LENGTHS[:n]) for n in (2, 4, 8)}
    assert sum(counts[2].values()) > 0
    for n in (4, 8):
        grown = {
            op: (counts[2][op], c)
            for op, c in (counts[2] | counts[n]).items()
            if counts[n][op] != counts[2][op]
        }
        assert not grown, f"launches per op that differ (2 requests, {n}): {grown}"
