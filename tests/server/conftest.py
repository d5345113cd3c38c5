"""One server for the whole server suite: `python -m engine.serve` on 127.0.0.1 in a subprocess.

It speculates with the tiny V4.1's DSpark head, so every API path also runs through draft verification.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "sk-test"
MODEL = "tiny"
MAX_MODEL_LEN = 1024


@dataclass
class Served:
    url: str  # http://127.0.0.1:PORT
    log: Path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics by name and labels, e.g. 'vllm:num_requests_running{model_name="tiny"}'."""
        lines = httpx.get(f"{self.url}/metrics", timeout=30).text.splitlines()
        samples = (line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))
        return {name: float(value) for name, value in samples}

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of `name` whose labels include `labels`."""
        total = 0.0
        for key, value in self.metrics().items():
            base, _, rest = key.partition("{")
            if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
                total += value
        return total

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until no sequence runs or waits and the KV cache is empty (the gauges follow the last step)."""
        deadline = time.monotonic() + timeout
        while True:
            busy = [
                self.metric(m)
                for m in (
                    "vllm:num_requests_running",
                    "vllm:num_requests_waiting",
                    "vllm:kv_cache_usage_perc",
                )
            ]
            if not any(busy):
                return
            assert time.monotonic() < deadline, f"still busy: running, waiting, cache = {busy}"
            time.sleep(0.1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: Callable[[], str | None], log: Path) -> None:
    """Until the server at ``url()`` (None: not known yet) answers /health, failing if it exits first."""
    deadline = time.monotonic() + 300  # the first run writes the tiny checkpoint
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the server did not come up:\n{log.read_text()}")
        try:
            if (where := url()) and httpx.get(f"{where}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)


@contextmanager
def serving(log: Path, *flags: str) -> Iterator[tuple[Served, subprocess.Popen]]:
    """`python -m engine.serve` on a free port with `flags`, until the block ends (then it is stopped)."""
    port = _free_port()
    args = [sys.executable, "-m", "engine.serve", "--port", str(port), "--api-key", API_KEY, *flags]
    with log.open("w") as out:
        proc = subprocess.Popen(args, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    served = Served(f"http://127.0.0.1:{port}", log)
    try:
        wait_healthy(proc, lambda: served.url, log)
        yield served, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    flags = ["--served-model-name", MODEL, "other", "--max-model-len", str(MAX_MODEL_LEN),
             "--max-num-seqs", "64", "--torch-threads", "1", "--speculative-method", "dspark",
             "--num-speculative-tokens", "2", "--log-level", "warning"]  # fmt: skip
    with serving(tmp_path_factory.mktemp("server") / "server.log", *flags) as (served, proc):
        yield served
        proc.terminate()
        proc.wait(timeout=60)
