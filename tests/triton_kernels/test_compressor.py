from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from triton_kernels.compressor import (
    CompressBatch,
    CompressorParams,
    CompressorStates,
    compress,
    compress_ref,
    compress_triton,
)
from triton_kernels.quant import dequantize_int8
from triton_kernels.rope import rope_inv_freq

C, EPS = 16, 1e-6
# (ratio, overlap, ape, rope): V4 CSA and HCA, V4.1 ratio 2 and ratio 1.
KINDS = {
    4: (4, True, True, True),
    128: (128, False, True, True),
    2: (2, False, False, False),
    1: (1, False, False, False),
}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _params(ratio: int, c: int = C, seed: int = 0) -> CompressorParams:
    ratio, overlap, ape, rope = KINDS[ratio]
    width = (2 if overlap else 1) * c
    return CompressorParams(
        ratio,
        overlap,
        torch.rand(c, generator=_gen(seed)) + 0.5,
        EPS,
        torch.randn(ratio, width, generator=_gen(seed + 1)) if ape else None,
        rope_inv_freq(8, 10000.0) if rope else None,
    )


def _inputs(n: int, params: CompressorParams, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    width = (2 if params.overlap else 1) * params.norm_weight.numel()
    kv = torch.randn(n, width, generator=_gen(seed + 2))
    gate = 2 * torch.randn(n, width, generator=_gen(seed + 3)) if params.ratio > 1 else None
    return kv, gate


Run = Callable[..., None]


def _schedules(run: Run, kv, gate, params, chunks: list[int]) -> tuple[torch.Tensor, CompressorStates]:
    """Feed the same tokens to one request per chunk size, all requests batched in each call (ragged).

    Returns every request's entries ``[R, E, c]`` and the final states (row r = request r).
    """
    n, r, c = kv.shape[0], params.ratio, params.norm_weight.numel()
    reqs, entries = len(chunks), n // r
    states = CompressorStates.empty(reqs, r, c, params.overlap, kv.device)
    out = torch.full((reqs * entries, c), float("nan"))
    done = [0] * reqs
    while min(done) < n:
        active = [i for i in range(reqs) if done[i] < n]
        spans = [(done[i], min(done[i] + chunks[i], n)) for i in active]
        rows = torch.cat([torch.arange(a, b) for a, b in spans])
        closed = (rows + 1) // r
        owner = torch.cat([torch.full((b - a,), i) for i, (a, b) in zip(active, spans, strict=True)])
        slots = torch.where((rows + 1) % r == 0, owner * entries + closed - 1, -1).to(torch.int32)
        lengths = torch.tensor([0] + [b - a for a, b in spans])
        batch = CompressBatch.build(
            r,
            lengths.cumsum(0).to(torch.int32),
            torch.tensor([a for a, _ in spans], dtype=torch.int32),
            torch.tensor(active, dtype=torch.int32),
            slots,
        )
        run(kv[rows], None if gate is None else gate[rows], batch, states, params, out)
        for i, (_, b) in zip(active, spans, strict=True):
            done[i] = b
    return out.view(reqs, entries, c), states


def _defined_state(states: CompressorStates, row: int, n: int, ratio: int) -> list[torch.Tensor]:
    """The state where it is defined after n tokens: the open window's rows and the overlap slice."""
    held = n % ratio
    parts = [states.buffer_kv[row, :held], states.buffer_gate[row, :held]]
    if states.overlap_kv is not None:
        parts += [states.overlap_kv[row], states.overlap_gate[row]]
    return parts


def _assert_same_state(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _by_formula(kv: torch.Tensor, gate: torch.Tensor | None, params: CompressorParams) -> torch.Tensor:
    """model-spec §4.5 / §4.7 entry by entry and channel by channel, in float64 Python."""
    r, c = params.ratio, params.norm_weight.numel()
    ape = params.ape.double() if params.ape is not None else torch.zeros(r, kv.shape[1], dtype=torch.float64)
    kv, z = kv.double(), (gate.double() if gate is not None else torch.zeros_like(kv, dtype=torch.float64))
    entries = []
    for g in range(kv.shape[0] // r):
        row = []
        for ch in range(c):
            cb = ch + (c if params.overlap else 0)  # with overlap, group g contributes its Cb half
            slots = [(kv[g * r + j, cb], z[g * r + j, cb] + ape[j, cb]) for j in range(r)]
            if params.overlap and g > 0:  # and the previous group its Ca half
                slots += [(kv[(g - 1) * r + j, ch], z[(g - 1) * r + j, ch] + ape[j, ch]) for j in range(r)]
            top = max(float(s) for _, s in slots)
            weights = [math.exp(float(s) - top) for _, s in slots]
            row.append(sum(w * float(k) for w, (k, _) in zip(weights, slots, strict=True)) / sum(weights))
        rms = math.sqrt(sum(v * v for v in row) / c + EPS)
        row = [v / rms * float(params.norm_weight[ch]) for ch, v in enumerate(row)]
        if params.inv_freq is not None:  # rotate the trailing pairs at the group's first position g*r
            nope = c - 2 * params.inv_freq.numel()
            for i, f in enumerate(params.inv_freq.tolist()):
                angle = g * r * f
                x0, x1 = row[nope + 2 * i], row[nope + 2 * i + 1]
                row[nope + 2 * i] = x0 * math.cos(angle) - x1 * math.sin(angle)
                row[nope + 2 * i + 1] = x1 * math.cos(angle) + x0 * math.sin(angle)
        entries.append(row)
    return torch.tensor(entries, dtype=torch.float32).view(-1, c)


@pytest.mark.parametrize("ratio", [1, 2, 4, 128])
@pytest.mark.parametrize("run", [compress, compress_triton], ids=["op", "kernel"])
def test_entries_follow_the_model_spec_formulas(ratio: int, run: Run) -> None:
    params = _params(ratio, c=8)
    kv, gate = _inputs(2 * ratio + 1, params)
    out, _ = _schedules(run, kv, gate, params, [kv.shape[0]])
    torch.testing.assert_close(out[0], _by_formula(kv, gate, params), atol=1e-5, rtol=1e-5)


# Tokens fed to the kernel per ratio: the interpreter costs ~20 ms per entry and chunk size, so the
# kernel sees two HCA windows but fewer short windows than the reference's 301 tokens.
KERNEL_TOKENS = {1: 67, 2: 67, 4: 131, 128: 301}


@pytest.mark.parametrize("ratio", [1, 2, 4, 128])
def test_any_chunking_gives_the_one_shot_entries_and_state(ratio: int) -> None:
    params, chunks = _params(ratio), [301, 64, 7, 3, 1]
    for run, n in ((compress, 301), (compress_triton, KERNEL_TOKENS[ratio])):
        kv, gate = _inputs(n, params, seed=ratio)
        out, states = _schedules(run, kv, gate, params, chunks)
        one_shot, _ = _schedules(compress_ref, kv, gate, params, [n])
        one_shot_state = _defined_state(states, 0, n, ratio)
        for i in range(len(chunks)):
            torch.testing.assert_close(out[i], one_shot[0], atol=1e-6, rtol=1e-5)
            _assert_same_state(_defined_state(states, i, n, ratio), one_shot_state)


def _prefilled(params: CompressorParams, streams, starts: list[int], ids: list[int]) -> CompressorStates:
    """States after each request's first ``starts[i]`` tokens (reference, one call per request)."""
    c = params.norm_weight.numel()
    states = CompressorStates.empty(max(ids) + 1, params.ratio, c, params.overlap, "cpu")
    for (kv, gate), start, sid in zip(streams, starts, ids, strict=True):
        slots = torch.full((start,), -1, dtype=torch.int32)
        i32 = torch.int32
        cu, sid_t = torch.tensor([0, start], dtype=i32), torch.tensor([sid], dtype=i32)
        batch = CompressBatch.build(params.ratio, cu, torch.zeros(1, dtype=i32), sid_t, slots)
        compress_ref(
            kv[:start], None if gate is None else gate[:start], batch, states, params, torch.zeros(1, c)
        )
    return states


@pytest.mark.parametrize(
    ("ratio", "starts", "lengths"),
    [
        (4, [0, 3, 6, 13], [5, 1, 9, 0]),
        (128, [0, 120, 250], [130, 9, 140]),
        (2, [1, 4], [6, 1]),
        (1, [0, 7], [3, 2]),
    ],
)
@pytest.mark.parametrize("formats", ["fp32", "bf16", "int8"])
def test_kernel_matches_reference_on_a_ragged_batch(
    ratio: int, starts: list[int], lengths: list[int], formats: str
) -> None:
    """Requests part-way through a window, with a window closed before, several closing now, none, a slot
    left unstored; the state rows are not the batch order. The kernel reads kv and gate as the column
    ranges of one projection's output (rows at its stride), as the model computes them."""
    params = _params(ratio)
    dtype = torch.bfloat16 if formats == "bf16" else torch.float32
    streams = [
        _inputs(s + n, params, seed=7 * i) for i, (s, n) in enumerate(zip(starts, lengths, strict=True))
    ]
    ids = list(range(len(starts)))[::-1]
    states = _prefilled(params, streams, starts, ids)
    rows = [slice(s, s + n) for s, n in zip(starts, lengths, strict=True)]
    kv = torch.cat([k[r] for (k, _), r in zip(streams, rows, strict=True)]).to(dtype)
    gate = (
        None if ratio == 1 else torch.cat([g[r] for (_, g), r in zip(streams, rows, strict=True)]).to(dtype)
    )
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])
    closes = (positions + 1) % ratio == 0
    slots = torch.full_like(positions, -1)
    slots[closes] = torch.randperm(int(closes.sum()), generator=_gen(1)) + 1  # slot 0 stays unused
    slots[closes.nonzero()[-1]] = -1  # computed, not stored
    lengths_t = torch.tensor([0, *lengths])
    batch = CompressBatch.build(
        ratio,
        lengths_t.cumsum(0).to(torch.int32),
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(ids, dtype=torch.int32),
        slots.to(torch.int32),
    )
    results = []
    for run in (compress_ref, compress_triton):
        pool_dtype = torch.int8 if formats == "int8" else dtype
        out = torch.zeros(int(closes.sum()) + 1, C, dtype=pool_dtype)
        scale = torch.zeros(out.shape[0]) if formats == "int8" else None
        st = CompressorStates(*(None if x is None else x.clone() for x in vars(states).values()))
        stacked = run is compress_triton and gate is not None
        run(*(torch.cat([kv, gate], dim=1).split(kv.shape[1], dim=1) if stacked else (kv, gate)),
            batch, st, params, out, scale)  # fmt: skip
        results.append((out.float() if scale is None else dequantize_int8(out, scale), scale, st))
    (ref, ref_scale, ref_states), (got, got_scale, got_states) = results
    # int8: a value at a rounding boundary may land one step away.
    atol = {"fp32": 1e-5, "bf16": 2e-2, "int8": float(ref_scale.max()) * 1.01 if ref_scale is not None else 0}
    torch.testing.assert_close(got, ref, atol=atol[formats], rtol=0)
    if ref_scale is not None:
        torch.testing.assert_close(got_scale, ref_scale)
    for i, (s, n) in enumerate(zip(starts, lengths, strict=True)):
        _assert_same_state(
            _defined_state(got_states, ids[i], s + n, ratio), _defined_state(ref_states, ids[i], s + n, ratio)
        )


@pytest.mark.parametrize("ratio", [4, 2])
def test_stateless_call_compresses_complete_groups(ratio: int) -> None:
    params = _params(ratio)
    kv, gate = _inputs(4 * ratio + 1, params)
    slots = torch.where(
        torch.arange(kv.shape[0]) % ratio == ratio - 1, torch.arange(kv.shape[0]) // ratio, -1
    )
    batch = CompressBatch.single(ratio, 0, slots.to(torch.int32))
    outs = []
    for run in (compress_ref, compress_triton):
        outs.append(torch.zeros(4, C))
        run(kv, gate, batch, None, params, outs[-1])
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[0], _by_formula(kv, gate, params), atol=1e-5, rtol=1e-5)


def test_the_reference_reads_a_batch_written_in_place_afresh() -> None:
    """The reference finds a batch's windows once for every compressor of the batch (a step's layers);
    a batch whose fields are then written in place (a graph's static inputs) is read as it is now."""
    params = _params(4)
    kv, gate = _inputs(8, params)
    first, second = (
        torch.tensor(s, dtype=torch.int32)
        for s in ([-1, -1, -1, 0, -1, -1, -1, 1], [-1] * 3 + [1, -1, -1, -1, 0])
    )
    outs = []
    for batch in (CompressBatch.single(4, 0, first.clone()), CompressBatch.single(4, 0, second)):
        out = torch.zeros(2, C)
        compress_ref(kv, gate, batch, CompressorStates.empty(1, 4, C, True, "cpu"), params, out)
        outs.append(out)
    reused = CompressBatch.single(4, 0, first.clone())
    for slots, want in zip((first, second), outs, strict=True):
        reused.slots.copy_(slots)
        out = torch.zeros(2, C)
        compress_ref(kv, gate, reused, CompressorStates.empty(1, 4, C, True, "cpu"), params, out)
        assert torch.equal(out, want)
    assert not torch.equal(outs[0], outs[1])


def _call(ratio: int = 4, **change):
    params = _params(ratio)
    kv, gate = _inputs(8, params)
    args = {
        "kv": kv,
        "gate": gate,
        "batch": CompressBatch.single(
            ratio, 0, torch.tensor([-1, -1, -1, 0, -1, -1, -1, 1], dtype=torch.int32)
        ),
        "states": CompressorStates.empty(1, ratio, C, params.overlap, "cpu"),
        "params": params,
        "out": torch.zeros(2, C),
    }
    args.update(change)
    compress(**args)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kv": torch.zeros(8, C)}, r"kv: .* must be \[N, 32\]"),
        ({"gate": None}, "gate: must be given exactly when ratio > 1"),
        ({"out": torch.zeros(2, 8)}, r"out: .* must be \[num_slots, 16\]"),
        ({"out": torch.zeros(2, C, dtype=torch.int8)}, "out_scale: must be given"),
        ({"out": torch.zeros(1, C)}, r"slots: range \[-1, 1\] must lie in \[-1, 1\)"),
        (
            {"states": None, "batch": CompressBatch.single(4, 3, torch.full((8,), -1, dtype=torch.int32))},
            "needs a state",
        ),
        ({"states": CompressorStates(torch.zeros(1, 3, 32), torch.zeros(1, 3, 32))}, "overlap slices"),
        ({"states": CompressorStates.empty(1, 2, C, True, "cpu")}, r"buffer_kv: .* \(1, 3, 32\)"),
        ({"params": CompressorParams(4, True, torch.ones(C), 0.0)}, "eps: 0.0"),
        ({"params": CompressorParams(4, True, torch.ones(C), EPS, torch.zeros(2, 32))}, r"ape: .* \(4, 32\)"),
        ({"params": CompressorParams(4, True, torch.ones(C), EPS, inv_freq=torch.ones(9))}, "inv_freq"),
    ],
)
def test_contract_is_validated(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _call(**change)


def _batch(
    cu: list[int],
    start: list[int],
    ids: list[int],
    request: list[int] | None = None,
    order: list[int] | None = None,
) -> CompressBatch:
    """Given as is (``CompressBatch.build`` would derive request and order from the others): 8 tokens, by
    default all of request 0 in token order."""
    i32 = torch.int32
    return CompressBatch(
        torch.tensor(cu, dtype=i32), torch.tensor(start, dtype=i32), torch.tensor(ids, dtype=i32),
        torch.full((8,), -1, dtype=i32), torch.tensor(request or [0] * 8, dtype=i32),
        torch.tensor(order or range(8), dtype=i32),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        (_batch([0, 9], [0], [0]), "cu_seqlens: must rise from 0 to N = 8"),
        (_batch([0, 5, 3], [0, 0], [0, 1]), "smallest step -2"),
        (_batch([0, 4, 8], [0, 0], [1, 1]), "state_ids: .* 1 repeats"),
        (_batch([0, 4, 8], [0, 0], [0, 2]), r"state_ids: range \[0, 2\]"),
        (_batch([0, 8], [-4], [0]), r"start: range \[-4"),
        (_batch([0, 8], [0, 0], [0]), r"cu_seqlens: torch.int32 \(2,\) must be torch.int32 \(3,\)"),
        (_batch([0, 4, 8], [0, 0], [0, 1]), "request: 4 tokens not of the request"),
        (_batch([0, 4, 8], [0, 0], [0, 1], [0, 0, 0, 0, 1, 1, 1, 2]), "request: 1 tokens"),
        (_batch([0, 8], [0], [0], order=[0, 1, 2, 3, 4, 5, 6, 6]), "order: must be a permutation"),
    ],
)
def test_batch_is_validated(batch: CompressBatch, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _call(batch=batch, states=CompressorStates.empty(2, 4, C, True, "cpu"))
