from __future__ import annotations

import numpy as np
import pytest
import torch

from model.config.sections import bucket_layout
from model.engram import multipliers
from triton_kernels import engram, runtime
from triton_kernels.engram import (
    HashTables,
    engram_gather,
    engram_gather_ref,
    engram_gather_triton,
    engram_hash,
    engram_hash_ref,
    engram_hash_triton,
    hash_tables,
)

# (engram layer ids, N_max, h_E, prime search start, compressed vocabulary)
TOY = ((1, 4), 4, 2, 1000, 3437)
RELEASE = ((1, 14), 4, 8, 16000000, 99092)


def _tables(layers, n_max, heads, start, vocab, pad=2, extreme=False) -> HashTables:
    layout = bucket_layout(len(layers), n_max, heads, start)
    if extreme:  # the largest odd multipliers: products reach the top bits of int64
        bound = (2**63 - 1) // (vocab - 1)
        mult = [[bound - (1 - bound % 2) - 2 * s for s in range(n_max)] for _ in layers]
    else:
        mult = [multipliers(layer, n_max, vocab) for layer in layers]
    return hash_tables(mult, layout.primes, layout.offsets, pad, vocab)


def _cids(n: int, vocab: int, dead: tuple[int, ...] = (), seed: int = 0) -> torch.Tensor:
    cids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))
    cids[list(dead)] = -1
    return cids


@pytest.mark.parametrize(
    ("setting", "extreme"),
    [
        (TOY, False),
        (RELEASE, False),
        (RELEASE, True),
        (((3,), 2, 3, 50, 40), False),
        (((0,), 5, 1, 7, 9), True),
    ],
    ids=["toy", "release", "release-extreme-multipliers", "bigrams-3-heads", "5-grams-1-head"],
)
@pytest.mark.parametrize(
    ("n", "n_history", "dead"),
    [(70, 0, (0, 9, 40)), (37, 3, ()), (5, 1, (3,)), (1, 0, ()), (4, 3, (0, 1, 2, 3))],
    ids=["prefill-with-dead", "chunk-after-history", "short-history", "single-token", "all-dead"],
)
def test_hash_kernel_matches_reference(setting, extreme: bool, n: int, n_history: int, dead) -> None:
    tables = _tables(*setting, extreme=extreme)
    n_history = min(n_history, tables.max_ngram_size - 1, n)
    cids = _cids(n, setting[-1], tuple(d for d in dead if d < n), seed=n)
    if extreme:
        cids[::2] = setting[-1] - 1
    got = engram_hash_triton(cids, n_history, tables)
    ref = engram_hash_ref(cids, n_history, tables)
    assert got.dtype == ref.dtype == torch.int32 and got.shape == (n - n_history, *tables.primes.shape)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    lo = tables.offsets[None]
    assert torch.all((got >= lo) & (got < lo + tables.primes[None]))


def test_hash_reference_is_exact_int64() -> None:
    # A rolling value far above 2**53: a float shortcut anywhere in the reference would lose its low bits.
    tables = _tables(*RELEASE)
    c, s = RELEASE[-1] - 1, 3
    rolling = 0
    for k in range(tables.max_ngram_size):
        rolling ^= c * int(tables.multipliers[1, k])
    prime, offset = int(tables.primes[1, -1]), int(tables.offsets[1, -1])
    assert rolling > 2**60
    assert int(engram_hash_ref(torch.full((s + 1,), c), s, tables)[0, 1, -1]) == rolling % prime + offset


def test_hash_of_history_only_and_empty_chunk_do_not_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engram, "_engram_hash_tuned", None)  # any launch would fail
    tables = _tables(*TOY)
    assert engram_hash_triton(_cids(3, 10), 3, tables).shape == (0, 2, 6)
    assert engram_hash_triton(torch.zeros(0, dtype=torch.int64), 0, tables).shape == (0, 2, 6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "d", "ids_shape"),
    [(50, 32, (7, 6)), (9, 300, (4, 3)), (1000, 256, (2, 24)), (5, 8, (0, 6)), (3, 1, (5,))],
    ids=["toy", "row-over-block", "release-width", "empty", "one-column"],
)
def test_gather_kernel_matches_reference(rows: int, d: int, ids_shape, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows)
    table = torch.randn(rows, d, generator=gen).to(dtype)
    ids = torch.randint(0, rows, ids_shape, generator=gen, dtype=torch.int32)
    got = engram_gather_triton(table, ids)
    assert got.shape == (*ids_shape, d) and got.dtype == dtype
    torch.testing.assert_close(got, engram_gather_ref(table, ids), rtol=0, atol=0)


def test_gather_host_table() -> None:
    table = torch.randn(20, 16)
    ids = torch.tensor([[3, 19, 0], [7, 7, 2]])
    torch.testing.assert_close(engram_gather(table, ids, "cpu"), table[ids], rtol=0, atol=0)


def test_hash_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    tables, cids = _tables(*TOY), _cids(20, TOY[-1], (5,))
    on_cpu = engram_hash(cids, 2, tables)
    monkeypatch.setattr(runtime, "use_triton", lambda t: True)
    torch.testing.assert_close(engram_hash(cids, 2, tables), on_cpu, rtol=0, atol=0)


_LAYOUT = bucket_layout(1, 2, 1, 10)  # one layer, bigrams, one head: prime 11


def _tables_with(**override):
    good = {"multipliers": [[1, 3]], "primes": _LAYOUT.primes, "offsets": _LAYOUT.offsets, "pad": 0}
    return hash_tables(**{**good, "compressed_vocab": 8, **override})


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: _tables_with(multipliers=[[1]]),
            r"multipliers: shape \(1, 1\) must be \[L_E >= 1, N_max >= 2\]",
        ),
        (lambda: _tables_with(multipliers=[[1, 4]]), r"multipliers\[0\]\[1\]: 4 must be odd"),
        (
            lambda: _tables_with(multipliers=[[1, 2**62 + 1]]),
            r"multipliers\[0\]\[1\]: 4611686018427387905 must be odd and in \[1, 1317624576693539401\]",
        ),
        (lambda: _tables_with(primes=[[11], [13]]), r"primes: shape \(2, 1\) must be \[1, "),
        (lambda: _tables_with(primes=[[2**24 + 1]]), r"primes\[0\]\[0\]: 16777217 outside \[2, 16777216\)"),
        (
            lambda: _tables_with(offsets=[[2**31 - 5]]),
            r"offsets\[0\]\[0\]: 2147483643 outside \[0, 2147483636\]",
        ),
        (lambda: _tables_with(pad=8), r"pad: 8 outside \[0, 8\)"),
        (lambda: _tables_with(compressed_vocab=0), r"compressed_vocab: 0 outside \[1, "),
        (
            lambda: engram_hash(torch.zeros(2, 3, dtype=torch.int64), 0, _tables_with()),
            "cids: .* must be a 1-D",
        ),
        (lambda: engram_hash(torch.zeros(3), 0, _tables_with()), "cids: torch.float32"),
        (
            lambda: engram_hash(torch.zeros(3, dtype=torch.int64), 2, _tables_with()),
            r"n_history: 2 outside \[0, 1\]",
        ),
        (
            lambda: engram_hash(torch.zeros(3, dtype=torch.int64, device="meta"), 0, _tables_with()),
            "cids: device meta differs",
        ),
        (
            lambda: engram_gather(
                torch.zeros(4, 2, dtype=torch.int8), torch.zeros(1, dtype=torch.int64), "cpu"
            ),
            "table: torch.int8",
        ),
        (
            lambda: engram_gather(torch.zeros(4), torch.zeros(1, dtype=torch.int64), "cpu"),
            r"table: .* \(4,\) must be",
        ),
        (lambda: engram_gather(torch.zeros(4, 2), torch.zeros(1), "cpu"), "ids: dtype torch.float32"),
        (
            lambda: engram_gather(torch.zeros(4, 2, device="meta"), torch.zeros(1, dtype=torch.int64), "cpu"),
            "table: device meta is neither the host nor the output device cpu",
        ),
    ],
)
def test_validation(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_tables_are_int32_limbs_of_the_products() -> None:
    tables = _tables(*RELEASE, extreme=True)
    assert tables.limbs.dtype == torch.int32 and tables.limbs.shape == (2, 4, 3, RELEASE[-1])
    limbs = tables.limbs.long()
    products = limbs[:, :, 0] | (limbs[:, :, 1] << 21) | (limbs[:, :, 2] << 42)
    expected = torch.arange(RELEASE[-1])[None, None] * tables.multipliers[:, :, None]
    assert torch.equal(products, expected)
    assert np.all(tables.multipliers.numpy() % 2 == 1)
