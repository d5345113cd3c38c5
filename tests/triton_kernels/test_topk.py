from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from triton_kernels import runtime, topk
from triton_kernels.topk import candidate_blocks_ref, topk_positions_ref

pytestmark = pytest.mark.long  # among the longest test files: scheduled first (tests/conftest.py)

VISIBLE = (0, 1, 7, 8, 9, 1000, 5000)
INF = float("inf")


def _masked(scores: torch.Tensor, visible: tuple[int, ...]) -> torch.Tensor:
    hidden = torch.arange(scores.shape[1]) >= torch.tensor(visible)[:, None]
    return scores.masked_fill(hidden, -INF)


def _tie_free(visible: tuple[int, ...], n: int, seed: int = 0) -> torch.Tensor:
    """Distinct scores of both signs (a shuffled ramp), ``-inf`` beyond each row's visible length."""
    gen = torch.Generator().manual_seed(seed)
    ramp = (torch.randperm(len(visible) * n, generator=gen).float() - n) * 0.37
    return _masked(ramp.view(len(visible), n), visible)


def _visible(values: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize("k", [1, 16, 512])
def test_kernel_matches_reference_over_visible_lengths(k: int) -> None:
    scores = _tie_free(VISIBLE, max(VISIBLE))
    got = topk.topk_positions_triton(scores, k)
    assert got.dtype == torch.int32 and got.shape == (len(VISIBLE), k)
    assert torch.equal(got, topk_positions_ref(scores, k))
    for row, n in enumerate(VISIBLE):
        expected = torch.topk(scores[row, :n], min(k, n)).indices.sort().values
        assert got[row, : len(expected)].tolist() == expected.tolist()
        assert torch.all(got[row, len(expected) :] == -1)


def test_ties_go_to_the_lower_position() -> None:
    scores = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0], [0.0, -0.0, 0.0, -1.0, -0.0]])
    for select in (topk.topk_positions_triton, topk_positions_ref):
        assert select(scores, 2).tolist() == [[1, 2], [0, 1]]


def test_ties_over_several_tiles_stop_at_k() -> None:
    """Ties in every tile of a row wider than the selection tile: once k are taken, later tiles' ties are
    not (a row of equal scores, and one whose ties straddle the cut)."""
    scores = torch.ones(2, 1200)
    scores[1, 700:] = 2.0
    for k in (100, 600, 1100):
        assert torch.equal(topk.topk_positions_triton(scores, k), topk_positions_ref(scores, k)), k


def test_kernel_matches_reference_with_ties_infinities_and_masked_rows() -> None:
    gen = torch.Generator().manual_seed(1)
    scores = torch.randint(-2, 3, (6, 300), generator=gen).float()
    scores[0, ::3] = -0.0
    scores[1, 5::40] = INF  # a pinned entry is an ordinary, largest score
    scores[2] = -INF  # nothing visible
    scores[3, 100:] = -INF
    scores[4] = torch.randn(300, generator=gen) * 1e30  # large magnitudes of both signs
    scores[5, ::2] = -INF
    for k in (1, 5, 150, 300):
        assert torch.equal(topk.topk_positions_triton(scores, k), topk_positions_ref(scores, k)), k
    assert torch.all(topk.topk_positions_triton(scores, 7)[2] == -1)


def test_kernel_reads_strided_rows_and_k_above_n() -> None:
    wide = _tie_free((40, 40, 40), 64)
    scores = wide[:, 8:48]  # row stride 64
    assert torch.equal(topk.topk_positions_triton(scores, 50), topk_positions_ref(scores, 50))
    assert topk_positions_ref(scores, 50)[:, 40:].eq(-1).all()


@settings(max_examples=8, deadline=None)
@given(
    rows=st.integers(1, 4),
    n=st.integers(1, 300),
    k=st.sampled_from([1, 3, 64]),
    levels=st.sampled_from([3, 1000]),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_reference_random(rows: int, n: int, k: int, levels: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(-levels, levels, (rows, n), generator=gen).float() / 7
    scores[torch.rand(rows, n, generator=gen) < 0.2] = -INF
    assert torch.equal(topk.topk_positions_triton(scores, k), topk_positions_ref(scores, k))


@pytest.mark.parametrize(("block", "keep"), [(8, 6), (16, 2048), (1, 16)])
def test_candidate_kernel_matches_reference(block: int, keep: int) -> None:
    # Lengths 7, 9, 1000 and 5000 are not multiples of 16; 7 and 9 not of 8.
    scores, visible = _tie_free(VISIBLE, max(VISIBLE), seed=2), _visible(VISIBLE)
    got = topk.candidate_blocks_triton(scores, visible, block, keep)
    assert got.shape == (len(VISIBLE), keep)
    assert torch.equal(got, candidate_blocks_ref(scores, visible, block, keep))


def test_candidate_reference_invariants() -> None:
    visible = (0, 1, 7, 8, 9, 100, 300)
    scores = _tie_free(visible, 300, seed=3)
    scores[5, 40:70] = -INF  # a fully masked block inside the visible range is never kept
    block, keep = 4, 6
    got = candidate_blocks_ref(scores, _visible(visible), block, keep)
    for row, n in enumerate(visible):
        kept = [b for b in got[row].tolist() if b >= 0]
        assert kept == sorted(set(kept)) and got[row, len(kept) :].eq(-1).all()
        blocks = -(-n // block)
        assert len(kept) == min(keep, blocks)
        if n:
            assert (n - 1) // block in kept  # the newest block is pinned
        maxima = topk.block_scores_ref(scores[row : row + 1], _visible((n,)), block)[0]
        assert all(maxima[b] > -INF for b in kept)
    assert not set(range(10, 18)) & set(got[5].tolist())
    assert torch.equal(topk.candidate_blocks_triton(scores, _visible(visible), block, keep), got)


def test_public_ops_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    scores, visible = _tie_free((3, 50), 60), _visible((3, 50))
    on_cpu = topk.topk_positions(scores, 4), topk.candidate_blocks(scores, visible, 8, 3)
    assert torch.equal(on_cpu[0], topk_positions_ref(scores, 4))
    monkeypatch.setattr(runtime, "use_triton", lambda t: True)
    on_kernel = topk.topk_positions(scores, 4), topk.candidate_blocks(scores, visible, 8, 3)
    assert all(torch.equal(a, b) for a, b in zip(on_cpu, on_kernel, strict=True))


_S = torch.zeros(2, 10)
_V = _visible((3, 10))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: topk.topk_positions(_S.double(), 1), "scores: torch.float64"),
        (lambda: topk.topk_positions(_S[0], 1), r"scores: .* \(10,\) must be a 2-D"),
        (lambda: topk.topk_positions(_S, 2049), r"k: 2049 must be in \[0, 2048\]"),
        (lambda: topk.topk_positions(_S, -1), r"k: -1 must be in"),
        (lambda: topk.candidate_blocks(_S, _V.long(), 4, 2), "visible: torch.int64"),
        (lambda: topk.candidate_blocks(_S, _V[:1], 4, 2), r"visible: .* must be torch.int32 \(2,\)"),
        (
            lambda: topk.candidate_blocks(_S, _visible((3, 11)), 4, 2),
            r"visible: range \[3, 11\] .* \[0, 10\]",
        ),
        (lambda: topk.candidate_blocks(_S, _V, 6, 2), "candidate block_size: 6 must be a power of two"),
        (lambda: topk.candidate_blocks(_S, _V, 512, 2), r"block_size: 512 .* \[1, 256\]"),
        (lambda: topk.candidate_blocks(_S, _V, 4, 4096), r"topk_blocks: 4096 must be in \[0, 2048\]"),
    ],
)
def test_validation(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_empty_does_not_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(topk, "_topk_tuned", None)  # any launch would fail
    monkeypatch.setattr(topk, "_candidate_tuned", None)
    assert topk.topk_positions_triton(torch.zeros(0, 5), 3).shape == (0, 3)
    assert topk.topk_positions_triton(torch.zeros(2, 5), 0).shape == (2, 0)
    assert topk.candidate_blocks_triton(torch.zeros(0, 5), _visible(()), 4, 2).shape == (0, 2)
