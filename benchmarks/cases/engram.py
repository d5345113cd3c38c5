"""Engram hash and table-gather cases (V4.1 only).

The hash tables are the model's (its layers, n-gram size, heads, primes and compressed vocabulary);
one call hashes the phase's tokens as one chunk after a full history. The gather reads one row per
(token, column) from a device table of at most 2**20 rows (the release tables live in host memory; the
kernel's speed does not depend on the table's height). Traffic: ids, the hash's limb reads and outputs;
the gathered rows read and written once.
"""

from __future__ import annotations

import torch

from benchmarks.cases.case import Case, elements_bytes
from benchmarks.workload import Phase
from model.config import ModelConfig
from model.engram import multipliers
from triton_kernels import engram

_MAX_ROWS = 2**20


def engram_cases(cfg: ModelConfig, phase: Phase, dev: torch.device, dtype: torch.dtype) -> list[Case]:
    if cfg.engram is None:
        return []
    gen = torch.Generator(device=dev).manual_seed(0)
    e = cfg.engram
    layers, n_max, vocab, layout = len(e.layer_ids), e.max_ngram_size, e.compressed_vocab_size, e.layout
    tables = engram.hash_tables(
        [multipliers(layer, n_max, vocab) for layer in e.layer_ids],
        layout.primes,
        layout.offsets,
        0,
        vocab,
        dev,
    )
    history = n_max - 1
    cids = torch.randint(0, vocab, (history + phase.total,), generator=gen, device=dev)
    ids = engram.engram_hash_ref(cids, history, tables)
    rows = min(layout.rows[0], _MAX_ROWS)
    table = torch.randn(rows, e.head_dim, generator=gen, device=dev).to(dtype)
    row_ids = ids[:, 0] % rows  # the first layer's columns
    gathered = engram.engram_gather_ref(table, row_ids)
    limbs = phase.total * layers * n_max * 3 * 4
    return [
        Case(
            "engram",
            "engram_hash",
            phase,
            lambda: engram.engram_hash_ref(cids, history, tables),
            lambda: engram.engram_hash_triton(cids, history, tables),
            elements_bytes(cids, ids) + limbs,
        ),
        Case(
            "engram",
            "engram_gather",
            phase,
            lambda: engram.engram_gather_ref(table, row_ids),
            lambda: engram.engram_gather_triton(table, row_ids),
            2 * elements_bytes(gathered) + elements_bytes(row_ids),
        ),
    ]
