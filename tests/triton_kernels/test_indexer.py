from __future__ import annotations

import pytest
import torch

from triton_kernels import indexer, runtime
from triton_kernels.indexer import IndexQueries, KeyPool
from triton_kernels.quant import quantize_int8
from triton_kernels.topk import topk_positions_ref

pytestmark = pytest.mark.long  # among the longest test files: scheduled first (tests/conftest.py)

VISIBLE = (0, 1, 7, 8, 9, 1000, 5000)
HEADS, DIM = 4, 32


def _paged_table(entries: list[int], block_size: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """A block table over shuffled pool blocks (two spare), one unused ``-1`` column: (table, slots)."""
    counts = [-(-e // block_size) for e in entries]
    ids = torch.randperm(sum(counts) + 2, generator=gen).int()
    table = torch.full((len(entries), max(counts) + 1), -1, dtype=torch.int32)
    start = 0
    for r, c in enumerate(counts):
        table[r, :c] = ids[start : start + c]
        start += c
    return table, (sum(counts) + 2) * block_size


def _batch(
    visible: tuple[int, ...],
    requests: tuple[int, ...],
    block_size: int = 16,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> tuple[IndexQueries, KeyPool]:
    """Random queries, weights and keys; each request holds as many entries as its tokens can see."""
    gen = torch.Generator().manual_seed(seed)
    entries = [1] * (max(requests) + 1)
    for v, r in zip(visible, requests, strict=True):
        entries[r] = max(entries[r], v)
    table, slots = _paged_table(entries, block_size, gen)
    t = len(visible)
    q = torch.randn(t, HEADS, DIM, generator=gen).to(dtype)
    keys = torch.randn(slots, DIM, generator=gen).to(dtype)
    weights = torch.randn(t, HEADS, generator=gen)
    request, vis = (torch.tensor(v, dtype=torch.int32) for v in (requests, visible))
    return IndexQueries(q, weights, request, vis), KeyPool(keys, table, block_size)


def _ranked(
    visible: tuple[int, ...], int8: bool, block_size: int = 16, seed: int = 0
) -> tuple[IndexQueries, KeyPool]:
    """One request whose logits are exact in fp32 and tie-free: entry j scores rank(j) + a head term < 1/2.

    Head 0 reads the rank from two channels (``100 * hi + lo``); the other heads add
    ``±2^-8 * relu(dot)`` with channels in {-1, 0, 1}, so every value is a small dyadic rational
    and the kernel and the reference compute the same floats. Int8 operands carry scales of 1.
    """
    gen = torch.Generator().manual_seed(seed)
    entries = max(visible + (1,))
    table, slots = _paged_table([entries], block_size, gen)
    j = torch.arange(entries)
    slot = table[0, j // block_size].long() * block_size + j % block_size
    rank = torch.randperm(entries, generator=gen)
    keys = torch.randint(-1, 2, (slots, DIM), generator=gen).float()
    keys[slot, 0], keys[slot, 1] = (rank // 100).float(), (rank % 100).float()
    t = len(visible)
    q = torch.randint(-1, 2, (t, HEADS, DIM), generator=gen).float()
    q[:, :, :2] = 0  # heads >= 1 ignore the rank channels
    q[:, 0] = 0
    q[:, 0, 0], q[:, 0, 1] = 100, 1
    weights = torch.randint(0, 2, (t, HEADS), generator=gen).float().mul(2).sub(1) / 256
    weights[:, 0] = 1
    request, vis = torch.zeros(t, dtype=torch.int32), torch.tensor(visible, dtype=torch.int32)
    if int8:
        return (
            IndexQueries(q.to(torch.int8), weights, request, vis, torch.ones(t, HEADS)),
            KeyPool(keys.to(torch.int8), table, block_size, torch.ones(slots)),
        )
    return IndexQueries(q, weights, request, vis), KeyPool(keys, table, block_size)


def _quantised(queries: IndexQueries, pool: KeyPool) -> tuple[IndexQueries, KeyPool]:
    (q, qs), (k, ks) = quantize_int8(queries.q), quantize_int8(pool.keys)
    return (
        IndexQueries(q, queries.weights, queries.request, queries.visible, qs),
        KeyPool(k, pool.block_table, pool.block_size, ks),
    )


def _all_blocks(visible: torch.Tensor, block: int, width: int) -> torch.Tensor:
    ids = torch.arange(width, dtype=torch.int32).expand(visible.shape[0], -1)
    return torch.where(ids < (visible[:, None] + block - 1) // block, ids, -1).to(torch.int32)


# A ragged prefill of three requests (lengths not multiples of the block), then decode-like rows.
PREFILL = ((0, 37, 160, 1, 300, 77, 78), (0, 0, 0, 1, 1, 2, 2))
DECODE = ((5, 129, 64), (0, 1, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("shape", [PREFILL, DECODE], ids=["prefill", "decode"])
@pytest.mark.parametrize("block_size", [16, 1])
def test_logits_kernel_matches_reference(shape, block_size: int, dtype: torch.dtype) -> None:
    queries, pool = _batch(
        *shape, block_size=block_size, dtype=torch.float32 if dtype == torch.int8 else dtype
    )
    if dtype == torch.int8:
        queries, pool = _quantised(queries, pool)
    got = indexer.indexer_logits_triton(queries, pool)
    ref = indexer.indexer_logits_ref(queries, pool)
    assert got.shape == (len(shape[0]), pool.capacity) and got.dtype == torch.float32
    # The int8 path: exact int32 dots, rescaled in fp32, against the dequantised reference.
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))


@pytest.mark.parametrize("tuned", indexer._LOGITS_TUNED, ids=lambda tuned: tuned.name)
def test_every_logits_config_matches_reference(tuned) -> None:  # noqa: ANN001
    queries, pool = _batch(*PREFILL, block_size=16, dtype=torch.float32)
    if tuned.name == "logits_int8":
        queries, pool = _quantised(queries, pool)
    ref = indexer.indexer_logits_ref(queries, pool)
    for config in tuned.configs:
        with tuned.forced(config):
            got = indexer.indexer_logits_triton(queries, pool)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["logits", "topk"])
def test_a_key_pool_that_is_a_column_range_of_a_buffer_is_read_in_place(op: str, monkeypatch) -> None:
    # The KV cache's key pools are column ranges of one buffer: the kernels read them at their row stride.
    queries, pool = _batch(*DECODE, seed=5)
    buffer = torch.randn(pool.keys.shape[0], 3 * DIM, generator=torch.Generator().manual_seed(6))
    buffer[:, DIM : 2 * DIM] = pool.keys
    strided = KeyPool(buffer[:, DIM : 2 * DIM], pool.block_table, pool.block_size)
    copied = []
    contiguous = torch.Tensor.contiguous
    monkeypatch.setattr(torch.Tensor, "contiguous", lambda t, *a: copied.append(t.shape) or contiguous(t, *a))
    if op == "logits":
        torch.testing.assert_close(
            indexer.indexer_logits_triton(queries, strided), indexer.indexer_logits_ref(queries, pool)
        )
    else:
        got = indexer.indexer_topk_triton(queries, strided, 20)
        assert torch.equal(got, indexer.indexer_topk_ref(queries, pool, 20))
    assert strided.keys.shape not in copied, "the key pool was copied"


def test_reference_matches_dense_formula() -> None:
    queries, pool = _batch(*PREFILL)
    logits = indexer.indexer_logits_ref(queries, pool)
    for t in (2, 4):
        table = pool.block_table[queries.request[t]]
        j = torch.arange(int(queries.visible[t]))
        keys = pool.keys[table[j // 16].long() * 16 + j % 16]
        expected = (torch.relu(queries.q[t] @ keys.T) * queries.weights[t, :, None]).sum(0)
        torch.testing.assert_close(logits[t, : len(j)], expected)
        assert torch.all(logits[t, len(j) :] == -float("inf"))


@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
@pytest.mark.parametrize(("k", "split"), [(1, False), (16, False), (512, False), (16, True)])
def test_topk_matches_reference_over_visible_lengths(k: int, int8: bool, split: bool) -> None:
    queries, pool = _ranked(VISIBLE, int8)
    got = indexer.indexer_topk_triton(queries, pool, k, split)
    ref = indexer.indexer_topk_ref(queries, pool, k)
    assert got.shape == (len(VISIBLE), k) and got.dtype == torch.int32
    assert torch.equal(got, ref)
    for row, n in enumerate(VISIBLE):
        assert got[row].ge(0).sum() == min(k, n)


@pytest.mark.parametrize("split", [False, True], ids=["fused", "scored-then-selected"])
def test_topk_on_random_paged_batch(split: bool) -> None:
    queries, pool = _batch(*PREFILL, block_size=8, seed=3)
    assert torch.equal(
        indexer.indexer_topk_triton(queries, pool, 20, split), indexer.indexer_topk_ref(queries, pool, 20)
    )


def test_decode_batches_score_over_every_core() -> None:
    # Fewer tokens than cores: one fused task per token would leave cores idle.
    cores = runtime.num_aicore()
    assert indexer.score_split(cores - 1) and not indexer.score_split(cores)


@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
@pytest.mark.parametrize(("block", "keep", "split"), [(4, 6, False), (16, 8, False), (4, 6, True)])
def test_candidate_source_and_consumer_match_reference(
    block: int, keep: int, int8: bool, split: bool
) -> None:
    queries, pool = _ranked(VISIBLE, int8, seed=1)
    picked, blocks = indexer.indexer_topk_and_candidates_triton(queries, pool, 16, block, keep, split)
    ref_picked, ref_blocks = indexer.indexer_topk_and_candidates_ref(queries, pool, 16, block, keep)
    assert torch.equal(picked, ref_picked) and torch.equal(blocks, ref_blocks)
    assert blocks.shape == (len(VISIBLE), keep)
    consumed = indexer.indexer_topk_in_candidates_triton(queries, pool, 16, blocks, block)
    assert torch.equal(consumed, indexer.indexer_topk_in_candidates_ref(queries, pool, 16, blocks, block))
    # Every pick lies inside the candidates; fewer candidate positions than k leave -1.
    for row in range(len(VISIBLE)):
        inside = set(blocks[row][blocks[row] >= 0].tolist())
        assert all(p // block in inside for p in consumed[row].tolist() if p >= 0)
    assert consumed[VISIBLE.index(9)].ge(0).sum() == 9


@pytest.mark.parametrize("block", [4, 16])
def test_consumer_equals_one_level_when_candidates_cover_everything(block: int) -> None:
    queries, pool = _batch(*PREFILL, seed=4)
    width = -(-pool.capacity // block)
    everything = _all_blocks(queries.visible, block, width)
    one_level = indexer.indexer_topk_triton(queries, pool, 24)
    assert torch.equal(
        indexer.indexer_topk_in_candidates_triton(queries, pool, 24, everything, block), one_level
    )
    assert torch.equal(
        indexer.indexer_topk_in_candidates_ref(queries, pool, 24, everything, block), one_level
    )


def test_consumer_with_empty_and_partial_candidate_rows() -> None:
    queries, pool = _batch(*DECODE, seed=5)
    candidates = torch.tensor([[-1, -1, -1], [0, 7, -1], [3, -1, -1]], dtype=torch.int32)
    got = indexer.indexer_topk_in_candidates_triton(queries, pool, 8, candidates, 8)
    assert torch.equal(got, indexer.indexer_topk_in_candidates_ref(queries, pool, 8, candidates, 8))
    assert got[0].eq(-1).all()  # an all-masked row
    assert got[1].ge(0).all() and {p // 8 for p in got[1].tolist()} <= {0, 7}
    assert got[2].tolist() == list(range(24, 32))  # exactly k candidate positions: all picked


def test_int8_selects_the_fp32_positions() -> None:
    """Property of the Ascend format: at k = 512 the int8 indexer keeps >= 95% of the fp32 picks."""
    gen = torch.Generator().manual_seed(7)
    t, heads, dim, entries, k = 8, 16, 128, 4096, 512
    queries = IndexQueries(
        torch.randn(t, heads, dim, generator=gen),
        torch.randn(t, heads, generator=gen) * (heads * dim) ** -0.5,
        torch.zeros(t, dtype=torch.int32),
        torch.full((t,), entries, dtype=torch.int32),
    )
    pool = KeyPool.dense(torch.randn(entries, dim, generator=gen))
    exact = indexer.indexer_topk_ref(queries, pool, k)
    approx = indexer.indexer_topk_ref(*_quantised(queries, pool), k)
    overlap = [len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(exact, approx, strict=True)]
    print(f"int8 vs fp32 top-{k} overlap: mean {sum(overlap) / t:.4f}, min {min(overlap):.4f}")
    assert min(overlap) >= 0.95


def test_public_ops_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    queries, pool = _batch(*DECODE, seed=6)
    candidates = _all_blocks(queries.visible, 8, -(-pool.capacity // 8))

    def run_all():
        return (
            indexer.indexer_logits(queries, pool),
            indexer.indexer_topk(queries, pool, 8),
            *indexer.indexer_topk_and_candidates(queries, pool, 8, 8, 4),
            indexer.indexer_topk_in_candidates(queries, pool, 8, candidates, 8),
        )

    on_cpu = run_all()
    assert torch.equal(on_cpu[1], topk_positions_ref(on_cpu[0], 8))
    monkeypatch.setattr(runtime, "use_triton", lambda t: True)
    on_kernel = run_all()
    torch.testing.assert_close(on_kernel[0], on_cpu[0], rtol=1e-5, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(on_cpu[1:], on_kernel[1:], strict=True))


def test_dense_pool_is_an_identity_slot_list() -> None:
    keys = torch.randn(5, DIM)
    pool = KeyPool.dense(keys)
    assert pool.block_size == 1 and pool.capacity == 5 and pool.block_table.tolist() == [[0, 1, 2, 3, 4]]
    assert KeyPool.dense(keys[:0]).capacity == 0
    empty = IndexQueries(
        torch.zeros(2, HEADS, DIM),
        torch.ones(2, HEADS),
        torch.zeros(2, dtype=torch.int32),
        torch.zeros(2, dtype=torch.int32),
    )
    assert indexer.indexer_topk(empty, KeyPool.dense(keys[:0]), 0).shape == (2, 0)


def _call(op: str = "logits", **override):
    queries, pool = _batch((3, 20), (0, 1), block_size=8)
    q_fields = {f: override.pop(f) for f in list(override) if f in IndexQueries.__dataclass_fields__}
    p_fields = {f[5:]: override.pop(f) for f in list(override) if f.startswith("pool_")}
    queries = IndexQueries(**{**queries.__dict__, **q_fields})
    pool = KeyPool(**{**pool.__dict__, **p_fields})
    if op == "logits":
        return indexer.indexer_logits(queries, pool)
    if op == "consumer":
        return indexer.indexer_topk_in_candidates(
            queries, pool, override.get("k", 4), override["candidates"], override.get("block", 4)
        )
    return indexer.indexer_topk_and_candidates(
        queries, pool, override.get("k", 4), override.get("block", 4), 2
    )


def _i32(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"q": torch.zeros(2, DIM)}, r"q: shape \(2, 32\) must be \[T, H, D\]"),
        ({"q": torch.zeros(2, 65, DIM), "weights": torch.zeros(2, 65)}, r"H <= 64"),
        ({"q": torch.zeros(2, HEADS, 256)}, r"D <= 128"),
        ({"q": torch.zeros(2, HEADS, DIM, dtype=torch.float16)}, "q: dtype torch.float16"),
        ({"q": torch.zeros(2, HEADS, DIM, dtype=torch.int8)}, r"keys: .* \(int8 exactly when q is int8\)"),
        ({"pool_keys": torch.zeros(48, 16)}, r"keys: .* must be \[num_slots, 32\]"),
        ({"scale": torch.ones(2, HEADS)}, "q scale: must be given exactly when"),
        (
            {"weights": torch.ones(2, HEADS, dtype=torch.bfloat16)},
            r"weights: torch.bfloat16 .* torch.float32 \(2, 4\)",
        ),
        ({"request": _i32(0)}, r"request: .* must be torch.int32 \(2,\)"),
        ({"visible": _i32(3, 20).long()}, "visible: torch.int64"),
        ({"request": _i32(0, 2)}, r"request: range \[0, 2\] must lie in \[0, 2\)"),
        (
            {"visible": _i32(3, 50)},
            r"visible: range \[3, 50\] must lie in \[0, 32\] \(pool capacity: 4 blocks x 8\)",
        ),
        ({"pool_block_table": _i32(0, 1, 2, 3)}, r"block_table: shape \(4,\) must be \[R >= 1, max_blocks\]"),
        ({"pool_block_table": torch.zeros(2, 4, dtype=torch.int64)}, "block_table: torch.int64"),
        (
            {"pool_block_table": torch.full((2, 4), -1, dtype=torch.int32)},
            r"block_table: 4 entries .* first \[0, 0\] = -1",
        ),
        (
            {"pool_block_table": torch.full((2, 4), 9, dtype=torch.int32)},
            r"outside \[0, \d+\) \(pool blocks\)",
        ),
        ({"pool_block_size": 0}, "block_size: 0 must be >= 1"),
        ({"k": 3000}, r"k: 3000 must be in \[0, 2048\]"),
        ({"block": 3}, "candidate block_size: 3 must be a power of two"),
    ],
)
def test_validation(override: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _call("source" if {"k", "block"} & set(override) else "logits", **override)


@pytest.mark.parametrize(
    ("candidates", "match"),
    [
        (_i32(0, 1).view(1, 2), r"candidates: .* \(1, 2\) .* must be torch.int32 \(2, 2\)"),
        (torch.tensor([[0, 1], [2, 1]], dtype=torch.int32), "candidates: 1 rows break the order"),
        (torch.tensor([[-1, 1], [0, -1]], dtype=torch.int32), "candidates: 1 rows break the order"),
        (
            torch.tensor([[0, 9], [0, -1]], dtype=torch.int32),
            r"candidates: range \[-1, 9\] must lie in \[-1, 8\)",
        ),
    ],
)
def test_candidate_validation(candidates: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _call("consumer", candidates=candidates)


def test_empty_does_not_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("_LOGITS_TUNED", "_TOPK_TUNED"):
        monkeypatch.setattr(indexer, name, None)  # any launch would fail
    queries, pool = _batch((3,), (0,))
    none = IndexQueries(queries.q[:0], queries.weights[:0], queries.request[:0], queries.visible[:0])
    assert indexer.indexer_logits_triton(none, pool).shape == (0, pool.capacity)
    assert indexer.indexer_topk_triton(none, pool, 4).shape == (0, 4)
    assert indexer.indexer_topk_triton(queries, pool, 0).shape == (1, 0)
