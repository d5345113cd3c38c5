from __future__ import annotations

import pytest
import torch

from triton_kernels import paging, runtime
from triton_kernels.paging import block_slots, block_slots_ref, block_slots_triton

PER_BLOCK, WIDTH = 8, 5


def _table(seed: int = 0) -> torch.Tensor:
    """Three requests' block tables: some blocks not allocated (-1)."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randperm(40, generator=gen)[: 3 * WIDTH].view(3, WIDTH)
    table[0, 3:], table[2, 1] = -1, -1
    return table


def _slots_by_hand(table: torch.Tensor, rows: torch.Tensor, numbers: torch.Tensor) -> torch.Tensor:
    flat = numbers.reshape(len(rows), -1)
    out = torch.full(flat.shape, -1, dtype=torch.int32)
    for m, row in enumerate(rows.tolist()):
        for j, n in enumerate(flat[m].tolist()):
            if 0 <= n < WIDTH * PER_BLOCK and (block := int(table[row, n // PER_BLOCK])) >= 0:
                out[m, j] = block * PER_BLOCK + n % PER_BLOCK
    return out.view(numbers.shape)


@pytest.mark.parametrize("shape", [(4,), (4, 7)], ids=["one", "k"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_slots_follow_the_block_table(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Every number in and around the table (below 0, past it, in unallocated blocks) on both paths."""
    gen = torch.Generator().manual_seed(1)
    table, rows = _table(), torch.tensor([0, 2, 1, 0], dtype=dtype)
    numbers = torch.randint(-PER_BLOCK - 2, WIDTH * PER_BLOCK + 3, shape, generator=gen, dtype=dtype)
    numbers.view(-1)[:3] = torch.tensor([-1, WIDTH * PER_BLOCK, WIDTH * PER_BLOCK - 1])
    expected = _slots_by_hand(table, rows, numbers)
    assert torch.equal(block_slots_ref(table, rows, numbers, PER_BLOCK), expected)
    for config in paging._CONFIGS:
        with paging._slots_tuned.forced(config):
            assert torch.equal(block_slots_triton(table, rows, numbers, PER_BLOCK), expected)


def test_a_long_row_spans_tasks_and_nothing_reads_past_it() -> None:
    table, gen = _table(2), torch.Generator().manual_seed(3)
    rows = torch.randint(0, 3, (700,), generator=gen, dtype=torch.int32)
    numbers = torch.randint(-1, WIDTH * PER_BLOCK, (700, 5), generator=gen, dtype=torch.int32)
    out = block_slots_triton(table, rows, numbers, PER_BLOCK)  # 3500 items: tasks of 1024, one partial
    assert torch.equal(out, block_slots_ref(table, rows, numbers, PER_BLOCK))
    assert block_slots_triton(table, rows[:0], numbers[:0], PER_BLOCK).shape == (0, 5)


def test_public_op_dispatches(monkeypatch: pytest.MonkeyPatch) -> None:
    table, rows, numbers = _table(), torch.tensor([1, 2]), torch.tensor([[0, 9], [17, -1]])
    expected = block_slots_ref(table, rows, numbers, PER_BLOCK)
    assert torch.equal(block_slots(table, rows, numbers, PER_BLOCK), expected)
    monkeypatch.setattr(runtime, "use_triton", lambda t: True)
    assert torch.equal(block_slots(table, rows, numbers, PER_BLOCK), expected)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        ({"table": torch.zeros(3, WIDTH)}, r"table: torch.float32 \(3, 5\) must be \[B, W\]"),
        ({"rows": torch.zeros(2, 1, dtype=torch.int64)}, r"rows: torch.int64 \(2, 1\) must be \[M\]"),
        ({"numbers": torch.zeros(3, 2, dtype=torch.int64)}, r"numbers: torch.int64 \(3, 2\) must be \[2\]"),
        ({"per_block": 0}, "per_block: 0 must be >= 1"),
        ({"per_block": 2**22}, "per_block: 4194304 must be >= 1, 5 blocks of it under 16777216 slots"),
    ],
)
def test_validation(call: dict[str, object], match: str) -> None:
    args = {"table": _table(), "rows": torch.tensor([0, 1]), "numbers": torch.zeros(2, 2, dtype=torch.int64)}
    with pytest.raises(ValueError, match=match):
        block_slots(**{**args, "per_block": PER_BLOCK, **call})
