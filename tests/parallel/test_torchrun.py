"""Under torchrun the multi-node flags default to its variables, and explicit flags win."""

from __future__ import annotations

import pytest

from engine.parallel.group import Rendezvous
from engine.server.args import parse_args, torchrun_defaults
from engine.server.launch import rendezvous

# What torchrun's agent sets for the second of two machines, one server each, after two restarts.
NODE_1 = {
    "WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "1",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCHELASTIC_RESTART_COUNT": "2",
}


@pytest.fixture
def node_1(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in NODE_1.items():
        monkeypatch.setenv(name, value)


def test_outside_torchrun_nothing_changes():
    assert torchrun_defaults({}) == {}
    assert torchrun_defaults({"WORLD_SIZE": "4", "MASTER_PORT": "29500"}) == {}  # not torchrun's agent


def test_the_flags_default_to_torchruns_variables(node_1: None):
    meet = rendezvous(parse_args(["--tensor-parallel-size", "4"]))
    assert meet == Rendezvous("10.0.0.1", 29500, nnodes=2, node_rank=1, launcher_store="deepseek-ascend/2")
    assert list(meet.ranks_here(4)) == [2, 3]


def test_explicit_flags_win_over_torchrun(node_1: None):
    args = parse_args(["--nnodes", "4", "--node-rank", "3", "--master-addr", "10.0.0.9"])
    # Meeting away from torchrun's store, rank 0 serves its own.
    assert rendezvous(args) == Rendezvous("10.0.0.9", 29500, nnodes=4, node_rank=3)
    args = parse_args(["--node-rank", "0"])
    assert rendezvous(args) == Rendezvous("10.0.0.1", 29500, 2, 0, "deepseek-ascend/2")


def test_several_servers_per_machine_are_refused(node_1: None, monkeypatch: pytest.MonkeyPatch, capsys):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("WORLD_SIZE", "16")
    with pytest.raises(SystemExit):
        parse_args([])
    assert "LOCAL_WORLD_SIZE=8 servers per machine: run it with --nproc-per-node 1" in capsys.readouterr().err
