"""Two "nodes" on one machine through the launcher: node 1 is ``python -m engine.serve --nnodes 2
--node-rank 1``, node 0 the engine here; the greedy tokens are those of one process, and node 1 exits
cleanly when rank 0 stops the group."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from engine.workers import Rendezvous, free_port, load_ranks
from model.tiny import cached_tiny
from model.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [list(range(2, 30)), [0, 911, 37, 5]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ENGINE = {"max_num_batched_tokens": 16, "max_model_len": 128, "kv_cache_memory": 4 * 2**20}


def test_a_second_node_runs_rank_1_and_the_tokens_are_those_of_one_process(tmp_path: Path):
    path, port = cached_tiny("v41"), free_port()
    single = [
        o.outputs[0].token_ids for o in LLM(model=path, **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)
    ]
    node = ["--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1", "--master-port", str(port)]
    with (tmp_path / "node1.log").open("w") as log:
        node1 = subprocess.Popen(
            [sys.executable, "-m", "engine.serve", "--port", "0", "--device", "cpu", *node],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        config = EngineConfig(tensor_parallel_size=2, enable_prefix_caching=False, **ENGINE)
        meet = Rendezvous(port=port, nnodes=2)
        model, workers = load_ranks(path, torch.float32, torch.device("cpu"), config, meet=meet)
        try:
            assert workers.processes == []  # rank 1 lives on the other node
            engine = LLMEngine(model, load_tokenizer(path), config, workers=workers)
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
