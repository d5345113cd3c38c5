"""Starting the server as a vLLM user would: vLLM's DeepSeek-V4 launch line works unchanged; a port in use,
a context beyond the model's or a KV cache too small for one request fail at start, naming the numbers."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

import pytest

from engine import serve
from model.testing.tiny import cached_tiny
from tests.server.conftest import ROOT, serving, wait_healthy

# vLLM's recipe line for DeepSeek-V4-Flash, with the tiny checkpoint for the model and CPU values for the
# GPU-only ones (one device, the model's own KV cache format).
VLLM_LINE = [
    "--trust-remote-code", "--kv-cache-dtype", "auto", "--block-size", "16", "--tensor-parallel-size", "1",
    "--enable-expert-parallel", "--tokenizer-mode", "deepseek_v4", "--tool-call-parser", "deepseek_v4",
    "--enable-auto-tool-choice", "--reasoning-parser", "deepseek_v4",
    "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}', "--max-model-len", "2048",
    "--max-num-seqs", "8", "--served-model-name", "deepseek-ai/DeepSeek-V4-Flash", "--enforce-eager",
]  # fmt: skip


def run_serve(*flags: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "engine.serve", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return done, time.monotonic() - start


def test_vllm_launch_line_serves_unchanged(tmp_path):
    with serving(tmp_path / "server.log", str(cached_tiny("v4")), *VLLM_LINE) as (served, _):
        chat = served.client().chat.completions.create(
            model="deepseek-ai/DeepSeek-V4-Flash",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            extra_body={"chat_template_kwargs": {"thinking": True, "reasoning_effort": "high"}},
        )
        assert chat.choices[0].finish_reason in ("stop", "length")
    log = (tmp_path / "server.log").read_text()
    assert "non-default flags:" in log and "maximum concurrency" in log


def test_bf16_serves_a_request(tmp_path):
    with serving(tmp_path / "server.log", "--dtype", "bfloat16", "--device", "cpu") as (served, _):
        completion = served.client().completions.create(
            model=served.client().models.list().data[0].id, prompt="Hello", max_tokens=4, temperature=0.0
        )
        assert (
            completion.choices[0].finish_reason in ("stop", "length") and completion.usage.completion_tokens
        )
    assert "Model on cpu in torch.bfloat16" in (tmp_path / "server.log").read_text()


def test_a_port_in_use_fails_at_once_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done, elapsed = run_serve("--host", "127.0.0.1", "--port", str(port))
    assert done.returncode != 0 and f"127.0.0.1:{port}" in done.stderr
    assert elapsed < 2, elapsed


def test_port_0_serves_on_the_port_the_system_picked(tmp_path):
    log = tmp_path / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "engine.serve", "--host", "127.0.0.1", "--port", "0"],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip

    def announced() -> str | None:
        found = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", log.read_text())
        return found and found[1]

    try:
        wait_healthy(proc, announced, log)
        assert not announced().endswith(":0")
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_ctrl_c_while_loading_exits_130_without_a_traceback(monkeypatch, capsys):
    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("engine.server.launch.serve", interrupted)
    with pytest.raises(SystemExit) as exited:
        serve.main(["--host", "127.0.0.1", "--port", "0"])
    assert exited.value.code == 130 and capsys.readouterr().err == "interrupted while starting\n"


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--max-model-len", "2M"], "max_position_embeddings=1048576"),
        (["--kv-cache-memory", "64K"], "needs"),
        (["--kv-cache-memory", "99999TiB"], "exceeds the device's"),
        (["--quantization", "w8a8"], "quantization='w8a8': the checkpoint is stored as unquantized"),
        (["--generation-config", "/nonexistent"], "no generation_config.json"),
        (["--model", "deepseek-ai/DeepSeek-V4"], "--model deepseek-ai/DeepSeek-V4: no such checkpoint"),
        (["--model", str(ROOT / "pyproject.toml")], "pyproject.toml: no such checkpoint folder"),
    ],
)
def test_a_plan_that_cannot_serve_fails_before_serving(flags: list[str], named: str):
    done, _ = run_serve("--host", "127.0.0.1", "--port", free_port(), *flags)
    assert done.returncode != 0 and named in done.stderr, done.stderr[-2000:]
