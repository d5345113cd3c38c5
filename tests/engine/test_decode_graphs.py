"""Decode steps replayed as graphs equal the same steps run eagerly, bit for bit.

The ``fx`` backend traces a decode step with ``make_fx`` on fake tensors (nothing runs while tracing,
as in a device capture: a host read or a data-dependent shape fails the trace) and replays the
``GraphModule`` each step after filling its static inputs, exactly as the CUDA / NPU backends replay
theirs; the ``cpu`` backend traces the torch references op by op and replays them as TorchScript. Their
steps must equal the ``eager`` backend's (the same fixed-shape step, run each time) bit for bit, and
agree with the engine's plain eager steps (whose shapes follow the requests) to rounding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.cpu_graph import record, static
from engine.decode_graphs import DecodeGraphs, bucket, capture_sizes
from engine.llm_engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from engine.server.args import engine_config, parse_args
from engine.spec_decode.proposer import ScriptedProposer
from model.checkpoint import load_model
from model.testing.tiny import cached_tiny, write_tiny
from model.tokenizer import load_tokenizer
from triton_kernels import runtime

LENGTHS = (3, 9, 17, 30)
STEPS = 4


def decoding_engine(
    arch: str, lengths: tuple[int, ...], backend: str | None, drafts: int = 0
) -> tuple[LLMEngine, list]:
    """An engine whose requests have prefilled, with decode graphs of ``backend`` (None: none), and the
    list its runner appends each step's logits to. With ``drafts``, each decode step verifies that many
    scripted drafts (mostly wrong: the rollback runs)."""
    path = cached_tiny(arch)
    model = load_model(path)
    config = EngineConfig(
        max_num_batched_tokens=256, max_num_seqs=8, max_model_len=96, num_speculative_tokens=drafts or None
    )
    vocab = model.cfg.vocab_size
    proposer = (
        ScriptedProposer(lambda r, k: [(r.output[-1] * 7 + j) % vocab for j in range(k)]) if drafts else None
    )
    engine = LLMEngine(model, load_tokenizer(path), config, proposer)
    runner = engine.runner
    if backend is not None:
        widths = (1, 1 + drafts) if drafts else (1,)
        runner.graphs = DecodeGraphs(model, runner.pools, 8, 96 + drafts, backend, widths)
    gen = torch.Generator().manual_seed(3)
    for n in lengths:
        prompt = torch.randint(3, model.cfg.vocab_size, (n,), generator=gen).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=STEPS + 1, temperature=0.0))
    engine.step()
    seen, run = [], runner.run

    def recorded(chunks):
        out = run(chunks)
        seen.append(torch.cat(out.logits))
        return out

    runner.run = recorded
    return engine, seen


def test_capture_sizes_and_buckets() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(20)
    assert [bucket(sizes, n) for n in (1, 3, 5, 9, 17, 20, 21)] == [1, 4, 8, 16, 20, 20, None]


@pytest.mark.parametrize("backend", ["fx", "cpu"])
@pytest.mark.parametrize("arch", ["v4", "v41"])
@pytest.mark.parametrize("requests", [4, 3])  # a capture size, and one padded to it
def test_replayed_decode_steps_equal_eager(backend: str, arch: str, requests: int) -> None:
    lengths = LENGTHS[:requests]
    runs = {name: decoding_engine(arch, lengths, name) for name in (backend, "eager", None)}
    for _ in range(STEPS):
        for engine, _ in runs.values():
            engine.step()
    (graphs, replayed), (_, fixed), (_, plain) = runs.values()
    assert list(graphs.runner.graphs.steps) == [(4, 1)]
    module = graphs.runner.graphs.steps[4, 1].replay
    if backend == "fx":
        assert isinstance(module, torch.fx.GraphModule)
        assert not [
            n for n in module.graph.nodes if "nonzero" in str(n.target) or "_local_scalar" in str(n.target)
        ]
    for got, want, loose in zip(replayed, fixed, plain, strict=True):
        assert torch.equal(got, want)
        torch.testing.assert_close(got, loose, rtol=1e-4, atol=1e-4)
    outputs = [[r.output for r in engine.requests.values()] for engine, _ in runs.values()]
    assert outputs[0] == outputs[1] == outputs[2]


@pytest.mark.parametrize("backend", ["fx", "cpu"])
@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_replayed_verification_steps_equal_eager(backend: str, arch: str) -> None:
    runs = {name: decoding_engine(arch, LENGTHS[:3], name, drafts=2) for name in (backend, "eager", None)}
    for _ in range(STEPS):
        for engine, _ in runs.values():
            engine.step()
    (graphs, replayed), (_, fixed), (_, plain) = runs.values()
    assert (4, 3) in graphs.runner.graphs.steps  # 3 requests verifying 2 drafts each, padded to 4
    for got, want, loose in zip(replayed, fixed, plain, strict=True):
        assert torch.equal(got, want)
        torch.testing.assert_close(got, loose, rtol=1e-4, atol=1e-4)
    outputs = [[r.output for r in engine.requests.values()] for engine, _ in runs.values()]
    assert outputs[0] == outputs[1] == outputs[2]


def test_the_cpu_captures_its_graphs_when_asked() -> None:
    assert engine_config(parse_args(["--enforce-eager"])).enforce_eager
    assert engine_config(parse_args(["--cpu-graphs"])).cpu_graphs
    assert not engine_config(parse_args([])).enforce_eager
    assert not engine_config(parse_args([])).cpu_graphs
    path = cached_tiny("v4")
    model, tokenizer = load_model(path), load_tokenizer(path)
    assert LLMEngine(model, tokenizer, EngineConfig(max_model_len=96)).runner.graphs is None
    eager = EngineConfig(max_model_len=96, cpu_graphs=True, enforce_eager=True)
    assert LLMEngine(model, tokenizer, eager).runner.graphs is None
    graphs = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=1, max_model_len=96, cpu_graphs=True))
    assert graphs.runner.graphs.backend == "cpu"
    assert list(graphs.runner.graphs.steps) == [(1, 1)]  # every size captured at start


@pytest.mark.parametrize(("fp8", "kv_cache_dtype"), [(True, "auto"), (False, "int8")])
def test_cpu_graphs_over_quantised_weights_or_caches_keep_the_greedy_output(
    fp8: bool, kv_cache_dtype: str, tmp_path: Path
) -> None:
    """FP8 weights and an int8 KV cache: the ops whose references a CPU graph keeps whole."""
    path, outputs = write_tiny(tmp_path / "tiny", "v4", fp8=fp8), []
    for graphs in (False, True):
        config = EngineConfig(
            max_num_seqs=2, max_model_len=64, kv_cache_dtype=kv_cache_dtype, cpu_graphs=graphs
        )
        engine = LLMEngine(load_model(path), load_tokenizer(path), config)
        assert (engine.runner.graphs is not None) == graphs
        requests = [
            engine.add_request(list(range(3, 3 + n)), SamplingParams(max_tokens=8, temperature=0.0))
            for n in (5, 19)
        ]
        while engine.has_work:
            engine.step()
        outputs.append([list(r.output) for r in requests])
    assert outputs[0] == outputs[1]


def test_a_data_dependent_size_is_not_replayed() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    traced = make_fx(lambda x: x.nonzero().view(-1), tracing_mode="symbolic")(torch.arange(4))
    with pytest.raises(RuntimeError, match="data-dependent size"):
        static(traced)


def test_a_cpu_graph_makes_its_constants_once_unless_it_writes_them() -> None:
    """An arange only read may be made once, at record time; one the step writes in place is made at every
    replay (else the second replay would start from the first one's writes). The replay runs on one
    thread and gives the caller's thread count back."""
    table = torch.arange(6.0)

    def step() -> tuple[torch.Tensor, ...]:
        read = table[torch.arange(3)]
        written = torch.arange(3.0)
        written.add_(1)
        return read, written

    replay = record(step)
    threads = torch.get_num_threads()
    for _ in range(3):
        read, written = replay()
        assert torch.equal(read, torch.arange(3.0)) and torch.equal(written, torch.arange(1.0, 4.0))
    assert torch.get_num_threads() == threads


DEVICES = [
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
    pytest.param("npu", marks=pytest.mark.skipif(runtime.backend() != "npu", reason="needs an Ascend NPU")),
]


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_device_graphs_keep_the_greedy_output(kind: str, arch: str) -> None:
    path, outputs = cached_tiny(arch), []
    for eager in (True, False):
        model = load_model(path, torch.bfloat16, torch.device(kind))
        config = EngineConfig(max_num_seqs=8, max_model_len=128, enforce_eager=eager)
        engine = LLMEngine(model, load_tokenizer(path), config)
        assert (engine.runner.graphs is None) == eager
        gen = torch.Generator().manual_seed(5)
        requests = [
            engine.add_request(
                torch.randint(3, model.cfg.vocab_size, (n,), generator=gen).tolist(),
                SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
            )
            for n in (5, 17, 40)
        ]
        while engine.has_work:
            engine.step()
        outputs.append([list(r.output) for r in requests])
    assert outputs[0] == outputs[1]
