"""Engram (DeepSeek V4.1, model-spec §6): n-gram hash tables injected into the hc streams.

Its config section is ``model.config.EngramConfig`` (the ``engram_*`` keys, with the prime bucket layout of
§6.2). ``compressed_token_map builds the normalised token
map from a tokenizer and ``EngramHasher`` turns token ids into bucket ids for every Engram layer (§6.3),
carrying the request's last ``N_max - 1`` compressed ids so chunked prefill and decode hash exactly like
one-shot prefill. ``Engram`` is one layer's lookup and gated fusion (§6.4), mounted by the model as
``layers.N.engram``.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import nn

from model.config import EngramConfig
from model.quant_linear import DenseLinear
from triton_kernels.custom_ops import engram_gate, engram_gather, engram_hash
from triton_kernels.engram import HashTables, hash_tables
from triton_kernels.quant_matmul import decode_e4m3, decode_e8m0
from triton_kernels.shared import take_rows

_SEED_PRIME = 10007
_INT64_MAX = 2**63 - 1
_WHITESPACE_RUN = re.compile(r"[ \t\r\n]+")
# Unicode White_Space, what `tokenizers`' Strip removes; Python's str.strip would also drop U+001C..U+001F.
_WHITE_SPACE = (
    "\t\n\v\f\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u2028\u2029\u202f\u205f\u3000"
)
_MARKS = ("Mn", "Mc", "Me")
_REPLACEMENT = "\ufffd"


def multipliers(layer_id: int, max_ngram_size: int, compressed_vocab_size: int) -> np.ndarray:
    """The odd per-look-back multipliers of one Engram layer, int64 [N_max]."""
    bound = max(1, _INT64_MAX // compressed_vocab_size // 2)
    draws = np.random.default_rng(_SEED_PRIME * layer_id).integers(
        0, bound, size=max_ngram_size, dtype=np.int64
    )
    return 2 * draws + 1


def normalize_token_text(text: str) -> str:
    """NFKC, NFD, drop combining marks, lowercase, collapse whitespace runs, then ``" "`` or strip."""
    text = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    text = "".join(c.lower() for c in text if unicodedata.category(c) not in _MARKS)
    text = _WHITESPACE_RUN.sub(" ", text)
    return text if text == " " else text.strip(_WHITE_SPACE)


def compressed_token_map(tokenizer: Tokenizer) -> tuple[np.ndarray, int]:
    """Token id -> compressed id (int64 [V]) and the number of compressed ids (model-spec §6.3)."""
    keys: dict[str, int] = {}
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    out = np.empty(vocab, dtype=np.int64)
    for tid in range(vocab):
        text = tokenizer.decode([tid], skip_special_tokens=False)
        if _REPLACEMENT in text:  # a partial UTF-8 sequence: key by the raw token string
            key = tokenizer.id_to_token(tid)
        else:
            key = normalize_token_text(text) or text
        out[tid] = keys.setdefault(key, len(keys))
    return out, len(keys)


@dataclass(frozen=True)
class EngramHasher:
    """Token ids -> bucket ids of every Engram layer, on the device that holds its tables."""

    config: EngramConfig
    token_map: torch.Tensor  # [V] int64
    tables: HashTables

    @classmethod
    def build(
        cls, config: EngramConfig, token_map: np.ndarray, device: torch.device | str = "cpu"
    ) -> EngramHasher:
        count = int(token_map.max()) + 1 if token_map.size else 0
        if count != config.compressed_vocab_size:
            raise ValueError(
                f"engram_compressed_vocab_size: {config.compressed_vocab_size} != {count}, the count of the "
                "tokenizer's compressed token map"
            )
        if config.pad_token_id >= token_map.size:
            raise ValueError(
                f"engram_pad_token_id: {config.pad_token_id} outside the vocabulary [0, {token_map.size})"
            )
        layout = config.layout
        tables = hash_tables(
            [multipliers(layer, config.max_ngram_size, count) for layer in config.layer_ids],
            layout.primes,
            layout.offsets,
            int(token_map[config.pad_token_id]),
            count,
            device,
        )
        return cls(config, torch.from_numpy(token_map).to(device), tables)

    @property
    def history_len(self) -> int:
        return self.config.max_ngram_size - 1

    def compress(self, token_ids: torch.Tensor, dead: torch.Tensor | None = None) -> torch.Tensor:
        """Compressed ids [S] int64, ``-1`` at dead positions. Token ids are not range-checked."""
        cids = self.token_map[token_ids.long()]
        return cids if dead is None else cids.masked_fill(dead, -1)

    def __call__(
        self, token_ids: torch.Tensor, history: torch.Tensor, dead: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Bucket ids [S, L_E, cols] int32 (offset per column) and the history to pass with the next chunk.

        ``history`` holds the request's last ``<= N_max - 1`` compressed ids (empty at its start; dead =
        -1); missing look-backs hash as pad. ``dead`` [S] bool marks image positions (text-only: None).
        """
        if token_ids.dim() != 1:
            raise ValueError(f"token_ids: shape {tuple(token_ids.shape)} must be [S]")
        if history.dim() != 1 or history.numel() > self.history_len:
            raise ValueError(
                f"history: shape {tuple(history.shape)} must be [H] with H <= {self.history_len}"
            )
        if dead is not None and (dead.dtype != torch.bool or dead.shape != token_ids.shape):
            raise ValueError(f"dead: {dead.dtype} {tuple(dead.shape)} must be bool {tuple(token_ids.shape)}")
        cids = self._extend(history, token_ids, dead)
        return engram_hash(cids, history.numel(), self.tables), cids[-self.history_len :]

    def batch(
        self, token_ids: torch.Tensor, bounds: list[tuple[int, int]], histories: list[torch.Tensor | None]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``__call__`` for the flat tokens of several requests (request i owns ``token_ids[lo:hi]`` of
        ``bounds[i]`` and its look-back ``histories[i]``, None at its start), in one hash: the bucket ids
        and the look-backs after, ``[R, H]`` with -1 before a request's first id (as ``padded``'s).

        The requests' sequences (look-back, then tokens) are hashed as one, each after a dead id: a look-back
        that crosses it hashes as pad, as before a request's first token. The sequence is gathered from
        the tokens and the look-backs in one index, its positions laid out on the host: the ops do not
        grow with the requests."""
        device, size = self.token_map.device, self.history_len
        given = [h.to(device, torch.int64) for h in histories if h is not None]
        # Ids to gather from: a dead id, the tokens, then every look-back given, end to end.
        source = torch.cat(
            [torch.full((1,), -1, dtype=torch.int64, device=device), self.compress(token_ids), *given]
        )
        order, picked, backs, held = [], [], [], 1 + token_ids.numel()
        for (lo, hi), history in zip(bounds, histories, strict=True):
            length = 0 if history is None else history.numel()
            dead = len(order)  # this request's dead id, where its look-backs stop
            order += [0, *range(held, held + length), *range(1 + lo, 1 + hi)]
            held += length
            picked += range(len(order) - (hi - lo), len(order))
            backs.append([max(i, dead) for i in range(len(order) - size, len(order))])
        flat = source[torch.tensor(order, device=device)]
        buckets = engram_hash(flat, 0, self.tables)[torch.tensor(picked, dtype=torch.int64, device=device)]
        return buckets, flat[torch.tensor(backs, dtype=torch.int64, device=device).view(len(bounds), size)]

    def padded(self, token_ids: torch.Tensor, history: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch`` for ``B`` requests of equal length whose look-backs are the rows of ``history [B, H]``
        (``H = N_max - 1``, -1 before a request's first token: hashed as ``batch``'s separator): the
        bucket ids ``[B * L, L_E, cols]`` and the look-backs after, ``[B, H]``. Shapes only set the layout."""
        rows, size = history.shape
        # A token looks back at most H ids: its own request's (and -1 where the look-back starts).
        flat = torch.cat([history.to(self.token_map.device), self.compress(token_ids).view(rows, -1)], dim=1)
        buckets = engram_hash(flat.flatten(), 0, self.tables).unflatten(0, flat.shape)
        return buckets[:, size:].flatten(0, 1), flat[:, flat.shape[1] - size :]

    def advance(self, history: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """The look-back after ``token_ids`` without hashing them (a speculative rollback's kept tokens)."""
        return self._extend(history, token_ids, None)[-self.history_len :]

    def _extend(
        self, history: torch.Tensor, token_ids: torch.Tensor, dead: torch.Tensor | None
    ) -> torch.Tensor:
        return torch.cat((history.to(self.token_map.device, torch.int64), self.compress(token_ids, dead)))


class _Table(nn.Module):
    """The bucket table as the model computes in (bf16 / fp32)."""

    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))

    def lookup(self, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
        return engram_gather(self.weight, ids, device)


class Fp8Table(nn.Module):
    """The bucket table as the release stores it: E4M3 ``weight [rows, d]`` with one E8M0 ``scale`` per
    ``block`` columns of each row. Only the rows a step reads are decoded (integer ops, no fp8 dtype
    needed), on the device that computes; the table itself stays packed, on the host or the device."""

    def __init__(self, rows: int, dim: int, block: int):
        super().__init__()
        self.block = block
        self.register_buffer("weight", torch.empty(rows, dim, dtype=torch.float8_e4m3fn))
        self.register_buffer("scale", torch.empty(rows, -(-dim // block), dtype=torch.float8_e8m0fnu))

    def lookup(self, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
        ids = ids.to(self.weight.device, torch.int64)
        codes = take_rows(self.weight.view(torch.uint8), ids).to(device, non_blocking=True)
        scales = take_rows(self.scale.view(torch.uint8), ids).to(device, non_blocking=True)
        return (
            decode_e4m3(codes) * decode_e8m0(scales).repeat_interleave(self.block, -1)[..., : codes.shape[-1]]
        )


class Engram(nn.Module):
    """One Engram layer (model-spec §6.4): ``embed.weight``, ``wkv.weight``, ``q_weight``, ``k_weight``.

    ``embed.weight`` may stay in host memory (pinned) while the rest lives on the device: the lookup
    gathers on the host and copies only the rows it needs (``triton_kernels.engram.engram_gather``). The
    loader swaps in an ``Fp8Table`` and a packed ``wkv`` where the checkpoint stores them FP8.
    """

    def __init__(self, config: EngramConfig, layer_id: int):
        super().__init__()
        if layer_id not in config.layer_ids:
            raise ValueError(f"layer_id: {layer_id} is not one of engram_layer_ids {list(config.layer_ids)}")
        n, d = config.hc_mult, config.hidden_size
        self.cols, self.eps = config.cols, config.norm_eps
        self.embed: _Table | Fp8Table = _Table(
            config.num_embeddings[config.layer_ids.index(layer_id)], config.head_dim
        )
        self.wkv = DenseLinear(config.cols * config.head_dim, (n + 1) * d)
        self.q_weight = nn.Parameter(torch.empty(n, d))
        self.k_weight = nn.Parameter(torch.empty(n, d))

    def pack_table(self, block: int) -> None:
        """Hold the bucket table as stored FP8 bytes (the loader calls it on ``meta``)."""
        self.embed = Fp8Table(*self.embed.weight.shape, block)

    def keep_table_on_host(self, pin: bool) -> None:
        """Hold the bucket table (its tensors still unfilled) in host memory, pinned when the model
        computes on an accelerator, so that the copies of the rows a lookup reads run asynchronously."""
        embed = self.embed
        for name, t in [*embed.named_parameters(recurse=False), *embed.named_buffers(recurse=False)]:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            if isinstance(t, nn.Parameter):
                setattr(embed, name, nn.Parameter(host, requires_grad=False))
            else:
                embed.register_buffer(name, host)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, dead: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [S, n, D] streams, ``ids`` [S, cols] this layer's bucket ids, ``dead`` [S] bool -> like x."""
        n, d = self.q_weight.shape
        if x.dim() != 3 or x.shape[1:] != (n, d):
            raise ValueError(f"x: shape {tuple(x.shape)} must be [S, {n}, {d}]")
        s = x.shape[0]
        if ids.shape != (s, self.cols):
            raise ValueError(f"ids: shape {tuple(ids.shape)} must be ({s}, {self.cols})")
        if dead is not None and (dead.dtype != torch.bool or dead.shape != (s,)):
            raise ValueError(f"dead: {dead.dtype} {tuple(dead.shape)} must be bool ({s},)")
        kv = self.wkv(self.embed.lookup(ids, x.device).flatten(1).to(x.dtype)).float()
        return engram_gate(x, kv, self.q_weight, self.k_weight, self.eps, dead)
