"""How the ranks spread over machines, and the launch lines that cannot work."""

from __future__ import annotations

import pytest

from engine.parallel.group import Rendezvous


def test_each_node_holds_consecutive_ranks():
    assert [Rendezvous(port=29500, nnodes=2, node_rank=n).ranks_here(16) for n in (0, 1)] == [
        range(0, 8),
        range(8, 16),
    ]
    assert Rendezvous().ranks_here(4) == range(4)


@pytest.mark.parametrize(
    ("meet", "world", "named"),
    [
        (Rendezvous(port=29500, nnodes=3), 16, "tensor_parallel_size=16 does not divide over nnodes=3"),
        (Rendezvous(port=29500, nnodes=2, node_rank=2), 4, r"node_rank=2 must be in \[0, 2\)"),
        (Rendezvous(nnodes=2), 4, "nnodes=2: the nodes meet on a given master port"),
    ],
)
def test_impossible_layouts_are_refused_naming_the_numbers(meet: Rendezvous, world: int, named: str):
    with pytest.raises(ValueError, match=named):
        meet.ranks_here(world)
