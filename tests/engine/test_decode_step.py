"""A decode step of several requests: its model forward reads nothing back from the device, and launches
the compressor once per compressing layer whatever the number of requests.

What the read test measures: one decode step of several requests of different lengths, with every operator on
its Triton kernel (``DSV4_TRITON_ON_CPU=1``, interpreted), as the engine runs on an NPU or a GPU.
Inside ``batch_forward`` a dispatch hook records every ``aten._local_scalar_dense`` (what ``.item()``,
``int(t)``, ``bool(t)`` and a scalar ``.tolist()`` call) and patched ``Tensor.tolist`` / ``Tensor.cpu``
record every call. The recording pauses inside a kernel launch: the interpreter stands in for the
device there and reads its operands on the host by design. The CPU references are not measured:
on a device they do not run. The operators' debug range checks (``DSV4_CHECK_RANGES``) are off.
The routed experts of every format run ``moe_gemm`` (sorted by expert on the device): no exception.
"""

from __future__ import annotations

import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.llm_engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from model import compressor
from model.checkpoint import load_model
from model.testing.tiny import cached_tiny
from model.tokenizer import load_tokenizer
from triton_kernels import runtime
from triton_kernels.compressor import compress

pytestmark = pytest.mark.long  # among the longest test files: scheduled first (tests/conftest.py)

LENGTHS = (3, 9, 17, 30)
# A scalar read, and the ops whose output shape depends on the data (the host waits for it).
_SYNCING = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default}


class HostReads(TorchDispatchMode):
    """Where the device would be read back: one stack summary per read, while ``active``."""

    def __init__(self) -> None:
        super().__init__()
        self.active, self.reads = False, []

    def record(self, what: str) -> None:
        if self.active:
            frame = next(
                f for f in reversed(traceback.extract_stack()[:-2]) if "site-packages" not in f.filename
            )
            self.reads.append(f"{what} at {frame.filename.rsplit('/', 2)[-2:]}:{frame.lineno}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _SYNCING:
            self.record(str(func))
        return func(*args, **(kwargs or {}))


def paused(hook: HostReads, fn):
    def run(*args, **kwargs):
        hook.active, was = False, hook.active
        try:
            return fn(*args, **kwargs)
        finally:
            hook.active = was

    return run


def recorded(hook: HostReads, name: str, method):
    def run(self, *args, **kwargs):
        hook.record(name)
        return method(self, *args, **kwargs)

    return run


def watching(hook: TorchDispatchMode, forward):
    """``forward`` with ``hook.active`` (a recording switch) set while it runs."""

    def run(*args, **kwargs):
        hook.active = True
        try:
            return forward(*args, **kwargs)
        finally:
            hook.active = False

    return run


def decoding(arch: str, lengths: tuple[int, ...]) -> LLMEngine:
    """An engine whose requests have all prefilled: its next step decodes one token of each."""
    path = cached_tiny(arch)
    model, tokenizer = load_model(path), load_tokenizer(path)
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_batched_tokens=256))
    gen = torch.Generator().manual_seed(3)
    for n in lengths:
        prompt = torch.randint(3, model.cfg.vocab_size, (n,), generator=gen).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0))
    engine.step()
    return engine


@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_decode_step_forward_reads_nothing_back(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = decoding(arch, LENGTHS)
    model = engine.runner.model
    hook = HostReads()
    monkeypatch.setenv("DSV4_TRITON_ON_CPU", "1")
    monkeypatch.setattr(runtime, "check_ranges", lambda: False)
    monkeypatch.setattr(model, "batch_forward", watching(hook, model.batch_forward))
    monkeypatch.setattr(torch.Tensor, "tolist", recorded(hook, "tolist", torch.Tensor.tolist))
    monkeypatch.setattr(torch.Tensor, "cpu", recorded(hook, "cpu", torch.Tensor.cpu))
    from triton.runtime.interpreter import GridExecutor

    monkeypatch.setattr(GridExecutor, "__call__", paused(hook, GridExecutor.__call__))
    with hook:
        done = engine.step()
    assert len(done) == engine.step_tokens == len(LENGTHS)  # one decode token of every request
    assert hook.reads == [], "\n".join(hook.reads)


@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_compressor_launches_do_not_grow_with_the_requests(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    monkeypatch.setattr(
        compressor, "compress", lambda *args: calls.append(args[2].start.numel()) or compress(*args)
    )
    per_step = []
    for lengths in (LENGTHS[:1], LENGTHS):
        engine = decoding(arch, lengths)
        calls.clear()
        engine.step()
        assert sum(calls) == len(calls) * len(lengths)  # every call holds every request
        per_step.append(len(calls))
    assert per_step[0] > 0 and per_step[1] == per_step[0], per_step
