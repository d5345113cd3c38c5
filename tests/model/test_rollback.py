"""Rollback after a speculative call: every cache as if only the kept tokens had come (model-spec §13.23)."""

from __future__ import annotations

import pytest
import torch

from model.cache import SequenceState, group_name
from model.checkpoint import load_model
from model.compressor import Compressor
from model.plan import build_plan
from model.testing.tiny import cached_tiny


@pytest.fixture(scope="module", params=["v4", "v41"])
def model(request):
    return load_model(cached_tiny(request.param))


def slots_of(state: SequenceState, group: str, numbers: range) -> torch.Tensor:
    per_block = state.store.pools.slots_per_block[group]
    table = state.seq.tables[group]
    return torch.tensor(
        [table[n // per_block] * per_block + n % per_block for n in numbers], dtype=torch.long
    )


def assert_same_caches(model, got: SequenceState, want: SequenceState) -> None:
    """Dense state and every pool row a later call can read, compared through each state's own tables."""
    cfg, n = model.cfg, want.num_tokens
    assert got.num_tokens == n
    if want.seq.engram_history is not None:
        assert torch.equal(got.seq.engram_history, want.seq.engram_history)
    for name in ("compressors", "indexers"):
        mine, theirs = getattr(got.seq, name), getattr(want.seq, name)
        assert mine.keys() == theirs.keys()
        for layer, state in theirs.items():
            ratio = state.pending.buffer_kv.shape[1] + 1
            assert mine[layer].num_tokens == state.num_tokens and mine[layer].journal is None
            open_rows = n % ratio  # rows of the open window; the rest of the buffer is stale by design
            for field in ("buffer_kv", "buffer_gate"):
                a, b = getattr(mine[layer].pending, field), getattr(state.pending, field)
                torch.testing.assert_close(a[:, :open_rows], b[:, :open_rows], rtol=1e-4, atol=1e-5)
            if state.pending.overlap_kv is not None and n >= ratio:
                for field in ("overlap_kv", "overlap_gate"):
                    a, b = getattr(mine[layer].pending, field), getattr(state.pending, field)
                    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    pools_got, pools_want = got.store.pools, want.store.pools
    window = range(max(0, n - cfg.sliding_window), n)
    for plan in build_plan(cfg):
        a = pools_got.window[plan.index].data[slots_of(got, "window", window)]
        b = pools_want.window[plan.index].data[slots_of(want, "window", window)]
        if not plan.is_draft:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        if plan.has_compressor:
            group = group_name(plan.compress_ratio)
            entries = range(n // plan.compress_ratio)
            for pools in ("entries", "index_keys"):
                if plan.index in getattr(pools_want, pools):
                    a = getattr(pools_got, pools)[plan.index].data[slots_of(got, group, entries)]
                    b = getattr(pools_want, pools)[plan.index].data[slots_of(want, group, entries)]
                    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("prompt_len", "keep"),
    [
        (125, 1),  # only the pending token: the call had closed windows of ratios 2, 4 and 128
        (125, 2),  # rejected the token that closes the ratio-4 and ratio-128 windows (position 127)
        (125, 3),  # kept the closing token, rejected the one right after it
        (126, 5),
        (125, 6),  # everything kept
    ],
)
def test_rollback_equals_a_run_over_the_kept_tokens(model, prompt_len, keep):
    gen = torch.Generator().manual_seed(prompt_len)
    ids = torch.randint(3, model.cfg.vocab_size, (prompt_len + 6,), generator=gen)
    prompt, call = ids[:prompt_len], ids[prompt_len:]
    spec = model.new_state()
    model(prompt, spec)
    spec.seq.speculate()
    model(call, spec)
    model.rollback(spec.seq, call[:keep])
    plain = model.new_state()
    model(prompt, plain)
    model(call[:keep], plain)
    assert_same_caches(model, spec, plain)
    after = torch.randint(3, model.cfg.vocab_size, (5,), generator=gen)
    torch.testing.assert_close(model(after, spec), model(after, plain), rtol=1e-4, atol=2e-5)


def test_rollback_needs_speculate_and_a_valid_length(model):
    state = model.new_state()
    model(torch.tensor([5, 6, 7]), state)
    with pytest.raises(ValueError, match="without speculate"):
        state.seq.rollback(1)
    state.seq.speculate()
    model(torch.tensor([8, 9]), state)
    with pytest.raises(ValueError, match=r"keep=3 must be in \[0, 2\]"):
        state.seq.rollback(3)


@torch.no_grad()
@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize(("ratio", "overlap", "ape"), [(4, True, True), (8, False, True), (2, False, False)])
def test_compressor_rollback_replays_the_kept_prefix(monkeypatch, kernel, ratio, overlap, ape):
    """The journal replays through the same ``compress`` op, on the torch reference or the Triton kernel."""
    if kernel:
        monkeypatch.setenv("DSV4_TRITON_ON_CPU", "1")
    torch.manual_seed(ratio)
    compressor = Compressor(16, 8, ratio, 1e-6, overlap=overlap, ape=ape)
    for p in compressor.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(3 * ratio + 3, 16)
    prompt, call = x[: 2 * ratio - 1], x[2 * ratio - 1 :]
    for keep in (0, 1, 2, call.shape[0] - 1):
        spec = compressor.new_state(x.device)
        compressor.pool(prompt, spec)
        spec.speculate()
        compressor.pool(call, spec)
        spec.rollback(keep)
        plain = compressor.new_state(x.device)
        compressor.pool(prompt, plain)
        compressor.pool(call[:keep], plain)
        assert spec.num_tokens == plain.num_tokens and spec.journal is None
        # What the state is for: the next call's entries equal the ones after the kept tokens alone.
        after = torch.randn(2 * ratio, 16)
        got, first = compressor.pool(after, spec)
        want, first_want = compressor.pool(after, plain)
        assert first == first_want
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
