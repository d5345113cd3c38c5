from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, normalizers
from torch import nn

from model.config import EngramConfig, ModelConfig
from model.engram import (
    Engram,
    EngramHasher,
    compressed_token_map,
    multipliers,
    normalize_token_text,
)
from model.testing.tiny import toy_config
from model.tokenizer import PAD_ID, load_tokenizer

PROJECT_COMPRESSED_VOCAB = 3437  # the project tokenizer's 4096 ids, normalised (open point 9)
TOKEN_MAP, COUNT = compressed_token_map(load_tokenizer())
TOY = EngramConfig(
    layer_ids=(1, 4),
    num_embeddings=(6126, 6332),
    max_ngram_size=4,
    vocab_size=1000,
    n_heads=2,
    head_dim=32,
    pad_token_id=2,
    compressed_vocab_size=PROJECT_COMPRESSED_VOCAB,
    hc_mult=4,
    hidden_size=128,
    norm_eps=1e-20,
)
RELEASE = replace(
    TOY,
    layer_ids=(1, 14),
    num_embeddings=(384006168, 384016682),
    vocab_size=16000000,
    n_heads=8,
    head_dim=256,
    compressed_vocab_size=99092,
    hidden_size=5120,
)
TOY_HASHER = EngramHasher.build(TOY, TOKEN_MAP)
# The release's compressed vocabulary without its tokenizer: every token its own compressed id.
RELEASE_HASHER = EngramHasher.build(RELEASE, np.arange(99092, dtype=np.int64))


# --- independent model of §6.2/§6.3, straight from the spec's pseudo-code, in Python integers ---


@functools.cache
def _spec_primes(n_layers: int, n_max: int, heads: int, start: int) -> list[list[int]]:
    def is_prime(n: int) -> bool:
        return n >= 2 and all(n % f for f in range(2, int(n**0.5) + 1))

    used, out = set(), []
    for _ in range(n_layers):
        layer = []
        for _order in range(2, n_max + 1):
            running = start - 1
            for _head in range(heads):
                running += 1
                while not is_prime(running) or running in used:
                    running += 1
                used.add(running)
                layer.append(running)
        out.append(layer)
    return out


def _spec_hash(cfg: EngramConfig, cid: list[int], pad: int) -> np.ndarray:
    """ids [S, L_E, cols] for a whole request; dead positions are -1 in ``cid``."""
    primes = _spec_primes(len(cfg.layer_ids), cfg.max_ngram_size, cfg.n_heads, cfg.vocab_size)
    bound = max(1, (2**63 - 1) // cfg.compressed_vocab_size // 2)
    out = np.zeros((len(cid), len(cfg.layer_ids), cfg.cols), dtype=np.int64)
    for slot, layer in enumerate(cfg.layer_ids):
        rng = np.random.default_rng(10007 * layer)
        mult = [
            2 * int(v) + 1 for v in rng.integers(low=0, high=bound, size=cfg.max_ngram_size, dtype=np.int64)
        ]
        offsets = [sum(primes[slot][:c]) for c in range(cfg.cols)]
        for p in range(len(cid)):
            blocked, rolling = False, 0
            for s in range(cfg.max_ngram_size):
                blocked = blocked or p - s < 0 or cid[p - s] == -1
                v = pad if blocked else cid[p - s]
                rolling = v * mult[s] if s == 0 else rolling ^ (v * mult[s])
                assert rolling < 2**63
                if s >= 1:
                    for h in range(cfg.n_heads):
                        col = (s - 1) * cfg.n_heads + h
                        out[p, slot, col] = rolling % primes[slot][col] + offsets[col]
    return out


def _chunked(hasher: EngramHasher, tokens: list[int], dead: list[bool], cuts: list[int]) -> torch.Tensor:
    history, out = torch.zeros(0, dtype=torch.int64), []
    bounds = [0, *sorted(set(cuts)), len(tokens)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        ids, history = hasher(
            torch.tensor(tokens[a:b], dtype=torch.int64), history, torch.tensor(dead[a:b], dtype=torch.bool)
        )
        out.append(ids)
    return torch.cat(out)


@pytest.mark.parametrize("which", ["toy", "release"])
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_chunked_hash_matches_spec(which: str, data: st.DataObject) -> None:
    hasher = TOY_HASHER if which == "toy" else RELEASE_HASHER
    vocab = hasher.token_map.numel()
    n = data.draw(st.integers(1, 24))
    tokens = data.draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    dead = data.draw(st.lists(st.integers(0, 4).map(lambda v: v == 0), min_size=n, max_size=n))
    cuts = data.draw(st.lists(st.integers(1, n), max_size=4))
    cid = [-1 if d else int(hasher.token_map[t]) for t, d in zip(tokens, dead, strict=True)]
    expected = _spec_hash(hasher.config, cid, int(hasher.token_map[PAD_ID]))
    got = _chunked(hasher, tokens, dead, cuts)
    assert got.dtype == torch.int32 and got.shape == expected.shape
    np.testing.assert_array_equal(got.numpy(), expected)


def test_a_batch_of_requests_hashes_as_each_alone() -> None:
    """``batch`` over requests with no look-back, a short one, a full one (a dead id in it), one of no new
    tokens and one whose ids do not fill a look-back: each request's buckets are those ``__call__`` gives
    it alone, and its look-back after (-1 before its first id) hashes its next tokens as the one
    ``__call__`` returns does."""
    gen = torch.Generator().manual_seed(5)
    histories = [None, torch.tensor([7]), torch.tensor([-1, 12, 30]), torch.tensor([4, 5]), None]
    lengths = [3, 1, 5, 0, 1]
    tokens = torch.randint(0, 4096, (sum(lengths),), generator=gen)
    ends = torch.tensor(lengths).cumsum(0).tolist()
    bounds = list(zip([0, *ends[:-1]], ends, strict=True))
    buckets, looks = TOY_HASHER.batch(tokens, bounds, histories)
    assert looks.shape == (len(lengths), TOY_HASHER.history_len)
    after = torch.randint(0, 4096, (4,), generator=gen)
    for (lo, hi), history, look in zip(bounds, histories, looks, strict=True):
        alone, kept = TOY_HASHER(
            tokens[lo:hi], torch.zeros(0, dtype=torch.int64) if history is None else history
        )
        assert torch.equal(buckets[lo:hi], alone)
        assert torch.equal(TOY_HASHER(after, look)[0], TOY_HASHER(after, kept)[0])
        assert torch.equal(look[look.numel() - kept.numel() :], kept)
        assert (look[: look.numel() - kept.numel()] == -1).all()


def test_decode_equals_prefill() -> None:
    tokens = torch.randint(0, 4096, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    no_dead = [False] * 40
    prefill = _chunked(TOY_HASHER, tokens, no_dead, [])
    assert torch.equal(_chunked(TOY_HASHER, tokens, no_dead, list(range(1, 40))), prefill)
    assert torch.equal(_chunked(TOY_HASHER, tokens, no_dead, [3, 4, 9, 31]), prefill)


def test_missing_history_hashes_as_pad() -> None:
    chunk, pad = torch.tensor([17, 300, 5]), TOY_HASHER.token_map[PAD_ID]
    start, _ = TOY_HASHER(chunk, torch.zeros(0, dtype=torch.int64))
    padded, _ = TOY_HASHER(chunk, pad.repeat(3))
    assert torch.equal(start, padded)
    other, _ = TOY_HASHER(chunk, torch.tensor([7, 8, 9]))
    assert not torch.equal(start[0], other[0])


def test_dead_position_blocks_farther_look_backs() -> None:
    def hashes(first: int, dead_at: int | None) -> torch.Tensor:
        tokens = torch.tensor([first, 11, 12, 13, 14])
        dead = torch.zeros(5, dtype=torch.bool)
        if dead_at is not None:
            dead[dead_at] = True
        return TOY_HASHER(tokens, torch.zeros(0, dtype=torch.int64), dead)[0]

    # Position 3's 4-gram reaches token 0 through positions 2 and 1.
    assert not torch.equal(hashes(40, None)[3], hashes(41, None)[3])
    assert torch.equal(hashes(40, 1)[3], hashes(41, 1)[3])
    # The dead position is blocked at look-back 0: it hashes pad-only n-grams.
    assert torch.equal(hashes(40, 2)[2], hashes(41, 2)[2])


def test_ids_lie_in_their_column_bucket() -> None:
    for hasher in (TOY_HASHER, RELEASE_HASHER):
        tokens = torch.randint(
            0, hasher.token_map.numel(), (200,), generator=torch.Generator().manual_seed(1)
        )
        ids, _ = hasher(tokens, torch.zeros(0, dtype=torch.int64))
        layout = hasher.config.layout
        lo, size = torch.tensor(layout.offsets), torch.tensor(layout.primes)
        assert torch.all((ids >= lo) & (ids < lo + size))
        assert torch.all(lo[:, -1] + size[:, -1] == torch.tensor(hasher.config.num_embeddings))


def test_layout_reproduces_toy_and_release() -> None:
    toy = TOY.layout
    assert toy.primes == ((1009, 1013, 1019, 1021, 1031, 1033), (1039, 1049, 1051, 1061, 1063, 1069))
    assert toy.rows == (6126, 6332)
    assert toy.offsets[1] == (0, 1039, 2088, 3139, 4200, 5263)
    release = RELEASE.layout
    assert release.rows == (384006168, 384016682)
    assert release.primes[0][:3] == (16000057, 16000079, 16000081) and release.primes[-1][-1] == 16000889
    assert [list(p) for p in toy.primes] == _spec_primes(2, 4, 2, 1000)


@pytest.mark.parametrize("cfg", [TOY, RELEASE], ids=["toy", "release"])
def test_multipliers_are_odd_seeded_draws(cfg: EngramConfig) -> None:
    bound = (2**63 - 1) // cfg.compressed_vocab_size // 2
    for layer in cfg.layer_ids:
        mult = multipliers(layer, cfg.max_ngram_size, cfg.compressed_vocab_size)
        draws = np.random.default_rng(10007 * layer).integers(
            0, bound, size=cfg.max_ngram_size, dtype=np.int64
        )
        assert mult.dtype == np.int64 and np.array_equal(mult, 2 * draws + 1)
        assert np.all(mult % 2 == 1)
        assert all(int(m) * (cfg.compressed_vocab_size - 1) < 2**63 for m in mult)


def test_compressed_token_map_of_the_project_tokenizer() -> None:
    assert COUNT == PROJECT_COMPRESSED_VOCAB
    assert TOKEN_MAP.dtype == np.int64 and TOKEN_MAP.shape == (4096,)
    # Ids by first appearance: each new id is one more than the largest so far.
    assert TOKEN_MAP[0] == 0 and np.all(np.diff(np.maximum.accumulate(TOKEN_MAP)) <= 1)
    assert TOKEN_MAP.max() + 1 == COUNT


def test_tokenizers_normaliser_chain_agrees() -> None:
    sentinel = "\ue000"  # protects a lone space from Strip, as the official chain does
    chain = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )
    tok = load_tokenizer()
    keys: dict[str, int] = {}
    chain_map = []
    for tid in range(tok.get_vocab_size(with_added_tokens=True)):
        text = tok.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(tid)
        else:
            key = chain.normalize_str(text)
            assert normalize_token_text(text) == key, (tid, text)
            key = key or text
        chain_map.append(keys.setdefault(key, len(keys)))
    assert np.array_equal(np.array(chain_map), TOKEN_MAP)
    for text in ("É", "ﬁ", "  \t\n", "\r\n", " Hello  World ", "Ａ", "\x1c", "\u00a0x"):
        assert normalize_token_text(text) == chain.normalize_str(text), text


def test_normalisation_rules() -> None:
    assert normalize_token_text("  \t\n ") == " "
    assert normalize_token_text(" Café\n") == "cafe"
    assert normalize_token_text("ﬁ") == "fi"
    assert normalize_token_text("a \t b") == "a b"
    tok = load_tokenizer()
    spaces = [t for t in range(4096) if (s := tok.decode([t])) and not s.strip(" \t\r\n")]
    assert len(spaces) > 1 and len({int(TOKEN_MAP[t]) for t in spaces}) == 1
    # Partial UTF-8 tokens all decode to U+FFFD; keyed by their raw strings they stay apart.
    partial = [t for t in range(4096) if "\ufffd" in tok.decode([t])]
    assert len(partial) > 1 and len({int(TOKEN_MAP[t]) for t in partial}) == len(partial)


def test_config_validation() -> None:
    with pytest.raises(
        ValueError, match=r"engram_num_embeddings\[1\]: 6333 != 6332, the sum of the primes of layer 4"
    ):
        replace(TOY, num_embeddings=(6126, 6333))
    with pytest.raises(ValueError, match=r"engram_num_embeddings: 1 entries != 2"):
        replace(TOY, num_embeddings=(6126,))
    with pytest.raises(ValueError, match=r"engram_layer_ids: \[4, 1\] must be"):
        replace(TOY, layer_ids=(4, 1))
    with pytest.raises(ValueError, match="engram_max_ngram_size: 1 must be >= 2"):
        replace(TOY, max_ngram_size=1)
    with pytest.raises(ValueError, match="rms_norm_eps: 0.0 must be > 0"):
        replace(TOY, norm_eps=0.0)
    with pytest.raises(ValueError, match="engram_compressed_vocab_size: 99092 != 3437"):
        EngramHasher.build(replace(TOY, compressed_vocab_size=99092), TOKEN_MAP)
    with pytest.raises(ValueError, match=r"engram_pad_token_id: 5000 outside the vocabulary \[0, 4096\)"):
        EngramHasher.build(replace(TOY, pad_token_id=5000), TOKEN_MAP)


def test_the_model_config_parses_its_engram_section_once() -> None:
    """The ``engram_*`` keys (the official ``engram_pad_id`` too) become ``ModelConfig.engram``, with the
    model's own widths; a missing key is named."""
    raw = toy_config("v41")
    raw["text_config"]["engram_pad_id"] = raw["text_config"].pop("engram_pad_token_id")
    assert ModelConfig.from_dict(raw).engram == TOY
    del raw["text_config"]["engram_n_heads"]
    with pytest.raises(ValueError, match="missing the required field 'engram_n_heads'"):
        ModelConfig.from_dict(raw)


def test_hasher_validation() -> None:
    empty = torch.zeros(0, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"history: shape \(4,\) must be \[H\] with H <= 3"):
        TOY_HASHER(torch.tensor([1]), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"token_ids: shape \(1, 2\)"):
        TOY_HASHER(torch.tensor([[1, 2]]), empty)
    with pytest.raises(ValueError, match="dead: torch.int64"):
        TOY_HASHER(torch.tensor([1, 2]), empty, torch.tensor([0, 1]))


def _engram(seed: int = 0) -> Engram:
    module = Engram(TOY, layer_id=4)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.02 if p.shape[0] == 6332 else 0.1))
    return module


def test_engram_tensor_names() -> None:
    layer = nn.Module()
    layer.engram = Engram(TOY, layer_id=1)
    shapes = {k: tuple(v.shape) for k, v in layer.state_dict().items()}
    assert shapes == {
        "engram.embed.weight": (6126, 32),
        "engram.wkv.weight": (5 * 128, 6 * 32),
        "engram.q_weight": (4, 128),
        "engram.k_weight": (4, 128),
    }
    with pytest.raises(ValueError, match=r"layer_id: 2 is not one of engram_layer_ids \[1, 4\]"):
        Engram(TOY, layer_id=2)


def _fusion_spec(m: Engram, x: torch.Tensor, ids: torch.Tensor, dead: torch.Tensor) -> torch.Tensor:
    n, d = m.q_weight.shape
    out = x.clone()
    for t in range(x.shape[0]):
        e = torch.cat([m.embed.weight[int(i)] for i in ids[t]])
        kv = m.wkv.weight @ e
        val = kv[n * d :]
        for i in range(n):
            xi, key = x[t, i], kv[i * d : (i + 1) * d]
            q = xi / torch.sqrt((xi**2).mean() + m.eps) * m.q_weight[i]
            k = key / torch.sqrt((key**2).mean() + m.eps) * m.k_weight[i]
            dot = float((q * k).sum()) / d**0.5
            g = 0.0 if dead[t] else 1 / (1 + np.exp(-np.sign(dot) * np.sqrt(max(abs(dot), 1e-6))))
            out[t, i] = xi + g * val
    return out


def test_engram_fusion() -> None:
    m = _engram()
    tokens = torch.randint(0, 4096, (6,), generator=torch.Generator().manual_seed(2))
    dead = torch.tensor([False, False, True, False, False, False])
    ids = TOY_HASHER(tokens, torch.zeros(0, dtype=torch.int64), dead)[0][:, 1]
    x = torch.randn(6, 4, 128, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = m(x, ids, dead)
        assert out.shape == x.shape and out.dtype == torch.float32
        torch.testing.assert_close(out, _fusion_spec(m, x, ids, dead), rtol=1e-5, atol=1e-5)
        assert torch.equal(out[2], x[2])  # gate 0 at the dead position
        assert not torch.equal(m(x, ids)[2], x[2])
        # In bf16 as the loader holds it: table and wkv in bf16, the q / k norm weights in fp32.
        half = _engram().bfloat16()
        half.q_weight.data, half.k_weight.data = m.q_weight.data, m.k_weight.data
        out = half(x.bfloat16(), ids)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), m(x.bfloat16().float(), ids), rtol=1e-2, atol=1e-2)


def test_engram_validation() -> None:
    m = _engram()
    x, ids = torch.zeros(3, 4, 128), torch.zeros(3, 6, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"x: shape \(3, 4, 64\) must be \[S, 4, 128\]"):
        m(torch.zeros(3, 4, 64), ids)
    with pytest.raises(ValueError, match=r"ids: shape \(3, 5\) must be \(3, 6\)"):
        m(x, ids[:, :5])
    with pytest.raises(ValueError, match=r"dead: torch.bool \(2,\) must be bool \(3,\)"):
        m(x, ids, torch.zeros(2, dtype=torch.bool))
