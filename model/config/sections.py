"""The config's nested sections, each checking its own fields when built: ``Yarn`` (``rope_scaling``),
``EngramConfig`` (the ``engram_*`` keys, with the prime bucket layout of model-spec §6.2) and
``DSparkConfig`` (the ``dspark_*`` keys)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from itertools import accumulate


@dataclass(frozen=True)
class Yarn:
    """YaRN frequency interpolation (``rope_scaling`` of the compressed-attention layers)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ValueError(f"factor: {self.factor} must be > 0")
        if self.original_max_position_embeddings < 1:
            raise ValueError(
                f"original_max_position_embeddings: {self.original_max_position_embeddings} must be >= 1"
            )
        if not self.beta_fast > self.beta_slow > 0:
            raise ValueError(
                f"beta_fast, beta_slow: {self.beta_fast}, {self.beta_slow} need beta_fast > beta_slow > 0"
            )


@dataclass(frozen=True)
class BucketLayout:
    """Primes and column offsets per Engram layer; column ``(o - 2) * h_E + h`` is order ``o``, head ``h``."""

    primes: tuple[tuple[int, ...], ...]
    offsets: tuple[tuple[int, ...], ...]

    @property
    def rows(self) -> tuple[int, ...]:
        return tuple(sum(p) for p in self.primes)


def _is_prime(n: int) -> bool:
    if n < 4:
        return n >= 2
    if n % 2 == 0 or n % 3 == 0:
        return False
    f = 5
    while f * f <= n:
        if n % f == 0 or n % (f + 2) == 0:
            return False
        f += 6
    return True


@functools.cache
def bucket_layout(n_layers: int, max_ngram_size: int, n_heads: int, vocab_size: int) -> BucketLayout:
    used: set[int] = set()
    primes = []
    for _ in range(n_layers):
        layer = []
        for _order in range(2, max_ngram_size + 1):
            candidate = vocab_size - 1  # the search restarts for every (layer, order)
            for _head in range(n_heads):
                candidate += 1
                while candidate in used or not _is_prime(candidate):
                    candidate += 1
                used.add(candidate)
                layer.append(candidate)
        primes.append(tuple(layer))
    offsets = tuple(tuple(accumulate(p[:-1], initial=0)) for p in primes)
    return BucketLayout(tuple(primes), offsets)


@dataclass(frozen=True)
class EngramConfig:
    layer_ids: tuple[int, ...]
    num_embeddings: tuple[int, ...]
    max_ngram_size: int
    vocab_size: int  # the prime search start
    n_heads: int
    head_dim: int
    compressed_vocab_size: int
    hc_mult: int  # the model's hc_mult, hidden_size and rms_norm_eps
    hidden_size: int
    norm_eps: float
    pad_token_id: int = 2

    def __post_init__(self) -> None:
        ids = self.layer_ids
        if not ids or list(ids) != sorted(set(ids)) or ids[0] < 0:
            raise ValueError(f"engram_layer_ids: {list(ids)} must be non-empty, sorted, unique and >= 0")
        if len(self.num_embeddings) != len(ids):
            raise ValueError(
                f"engram_num_embeddings: {len(self.num_embeddings)} entries != {len(ids)} engram layers"
            )
        for name, value, low in (
            ("engram_max_ngram_size", self.max_ngram_size, 2),
            ("engram_vocab_size", self.vocab_size, 1),
            ("engram_n_heads", self.n_heads, 1),
            ("engram_head_dim", self.head_dim, 1),
            ("engram_pad_token_id", self.pad_token_id, 0),
            ("engram_compressed_vocab_size", self.compressed_vocab_size, 1),
            ("hc_mult", self.hc_mult, 1),
            ("hidden_size", self.hidden_size, 1),
        ):
            if value < low:
                raise ValueError(f"{name}: {value} must be >= {low}")
        if not self.norm_eps > 0:
            raise ValueError(f"rms_norm_eps: {self.norm_eps} must be > 0")
        for slot, (layer, rows) in enumerate(zip(ids, self.num_embeddings, strict=True)):
            if rows != self.layout.rows[slot]:
                raise ValueError(
                    f"engram_num_embeddings[{slot}]: {rows} != {self.layout.rows[slot]}, the sum of the "
                    f"primes of layer {layer}"
                )

    @property
    def cols(self) -> int:
        return (self.max_ngram_size - 1) * self.n_heads

    @property
    def layout(self) -> BucketLayout:
        return bucket_layout(len(self.layer_ids), self.max_ngram_size, self.n_heads, self.vocab_size)


@dataclass(frozen=True)
class DSparkConfig:
    """The DSpark draft stages (model-spec §8.2), from the ``dspark_*`` keys: one stage per target layer."""

    target_layer_ids: tuple[int, ...]
    block_size: int
    markov_rank: int
    noise_token_id: int
    n_routed_experts: int = 0  # 0: the backbone's
    num_experts_per_tok: int = 0  # 0: the backbone's

    def __post_init__(self) -> None:
        ids = self.target_layer_ids
        if list(ids) != sorted(set(ids)):
            raise ValueError(f"config: dspark_target_layer_ids={list(ids)} must be sorted and unique")
        for name in ("block_size", "markov_rank"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config: dspark_{name}={getattr(self, name)} must be positive")
        for name in ("n_routed_experts", "num_experts_per_tok"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"config: dspark_{name}={getattr(self, name)} must be >= 0 (0: the backbone's)"
                )


def num_draft_layers(dspark: DSparkConfig | None, num_nextn_predict_layers: int) -> int:
    """DSpark has one stage per target layer (V4 releases keep ``num_nextn_predict_layers: 1``)."""
    return len(dspark.target_layer_ids) if dspark else num_nextn_predict_layers
