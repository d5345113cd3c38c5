"""Two "nodes" on one machine, started as torchrun starts them: node 1 is ``python -m engine.serve`` with
torchrun's variables for the second machine and no multi-node flag, node 0 the engine here, and the test
serves the store as torchrun's agent does. The greedy tokens are those of one process, and node 1 exits
cleanly when rank 0 stops the group."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.factory import build_engine
from engine.llm import LLM
from engine.parallel.group import free_port
from engine.parallel.processes import load_ranks
from engine.request import SamplingParams
from engine.server.args import parse_args
from engine.server.launch import rendezvous
from model.testing.tiny import cached_tiny
from model.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [list(range(2, 30)), [0, 911, 37, 5]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ENGINE = {"max_num_batched_tokens": 16, "max_model_len": 128, "kv_cache_memory": 4 * 2**20}


def test_a_second_node_runs_rank_1_and_the_tokens_are_those_of_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    path, port = cached_tiny("v41"), free_port()
    single = [
        o.outputs[0].token_ids for o in LLM(model=path, **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)
    ]
    agent = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=60), wait_for_workers=False)
    torchrun = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"}  # fmt: skip
    with (tmp_path / "node1.log").open("w") as log:
        node1 = subprocess.Popen(
            [sys.executable, "-m", "engine.serve", "--port", "0", "--device", "cpu", "-tp", "2"],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **torchrun, "GROUP_RANK": "1"},
        )  # fmt: skip
    try:
        for name, value in {**torchrun, "GROUP_RANK": "0"}.items():
            monkeypatch.setenv(name, value)
        meet = rendezvous(parse_args(["-tp", "2"]))
        assert (meet.nnodes, meet.node_rank, meet.port) == (2, 0, port) and meet.launcher_store
        config = EngineConfig(tensor_parallel_size=2, **ENGINE)
        model, workers = load_ranks(path, torch.float32, torch.device("cpu"), config, meet=meet)
        try:
            assert workers.processes == []  # rank 1 lives on the other node
            engine = build_engine(model, load_tokenizer(path), config, workers)
            requests = [engine.add_request(p, GREEDY) for p in PROMPTS]
            while engine.has_work:
                engine.step()
            assert [list(r.output) for r in requests] == single
        finally:
            workers.close()
        assert node1.wait(timeout=60) == 0, (tmp_path / "node1.log").read_text()
    finally:
        if node1.poll() is None:
            node1.kill()
        del agent
