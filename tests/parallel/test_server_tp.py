"""``python -m engine.serve --tensor-parallel-size 2`` on CPU: it serves the tiny V4.1 the greedy tokens
of one process, and when a worker is killed /health fails and the server exits with an error naming the
rank. The same server with ``--data-parallel-size 2 --enable-expert-parallel`` serves requests on both
ranks."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx

from engine.llm import LLM
from engine.request import SamplingParams
from model.testing.tiny import cached_tiny
from tests.server.conftest import serving

PROMPT = [0, 911, 37, 5, 1200, 64]


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def _one_process_text() -> str:
    """The greedy completion of ``PROMPT`` in one process: what every layout must serve."""
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    (output,) = LLM(model=cached_tiny("v41"), max_model_len=256).generate(PROMPT, greedy, use_tqdm=False)
    return output.outputs[0].text


def _greedy_reply(served, n: int = 1):
    return served.client().completions.create(
        model="deepseek-v4.1-tiny", prompt=PROMPT, max_tokens=6, temperature=0.0, n=n,
        extra_body={"ignore_eos": True},
    )  # fmt: skip


def test_tp2_server_serves_then_exits_when_a_worker_dies(tmp_path: Path):
    single = _one_process_text()
    flags = ["--tensor-parallel-size", "2", "--torch-threads", "1", "--max-model-len", "256",
             "--kv-cache-memory", "16MiB", "--log-level", "warning"]  # fmt: skip
    with serving(tmp_path / "server.log", *flags) as (served, proc):
        assert _greedy_reply(served).choices[0].text == single
        (worker,) = [
            pid for pid in _children(proc.pid) if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()
        ]
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 60  # a bound on the wait, not a speed requirement
        while _healthy(served.url) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _healthy(served.url)
        assert proc.wait(timeout=60) == 1
        assert "tensor-parallel rank 1 exited with code -9" in served.log.read_text()


def test_dp2_ep_server_serves_one_process_tokens_from_both_ranks(tmp_path: Path):
    """``n=2``: the two sequences go to the two ranks (each a whole engine) and both stream back the
    tokens of one process."""
    single = _one_process_text()
    flags = ["--data-parallel-size", "2", "--enable-expert-parallel", "--torch-threads", "1",
             "--max-model-len", "256", "--kv-cache-memory", "16MiB", "--log-level", "warning"]  # fmt: skip
    with serving(tmp_path / "server.log", *flags) as (served, _):
        assert [c.text for c in _greedy_reply(served, n=2).choices] == [single] * 2
        metrics = httpx.get(f"{served.url}/metrics", timeout=5).text
        assert "vllm:generation_tokens_total" in metrics
