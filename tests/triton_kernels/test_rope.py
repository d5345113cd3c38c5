from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4RotaryEmbedding,
    apply_rotary_pos_emb,
)

from model.config import Yarn
from triton_kernels import rope, runtime
from triton_kernels.rmsnorm import rms_norm_ref
from triton_kernels.rope import apply_rope, apply_rope_ref, apply_rope_triton, rope_inv_freq

TOY_YARN = Yarn(factor=16, original_max_position_embeddings=65536, beta_fast=32, beta_slow=1)
ROPE_DIM, HEAD_DIM = 16, 64


@pytest.fixture(scope="module")
def hf_rotary() -> DeepseekV4RotaryEmbedding:
    config = DeepseekV4Config(
        hidden_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        qk_rope_head_dim=ROPE_DIM,
        rope_theta=10000,
        compress_rope_theta=160000,
        rope_scaling={
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        max_position_embeddings=1048576,
    )
    return DeepseekV4RotaryEmbedding(config)


def _x(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _positions(t: int, seed: int = 0, high: int = 2**20) -> torch.Tensor:
    return torch.randint(0, high, (t,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("layer_type", "theta", "yarn"), [("main", 10000.0, None), ("compress", 160000.0, TOY_YARN)]
)
def test_inv_freq_matches_transformers(
    hf_rotary: DeepseekV4RotaryEmbedding, layer_type: str, theta: float, yarn: Yarn | None
) -> None:
    assert getattr(hf_rotary, f"{layer_type}_attention_scaling") == 1.0  # no YaRN magnitude factor
    expected = getattr(hf_rotary, f"{layer_type}_inv_freq")
    torch.testing.assert_close(rope_inv_freq(ROPE_DIM, theta, yarn), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("layer_type", "theta", "yarn"), [("main", 10000.0, None), ("compress", 160000.0, TOY_YARN)]
)
def test_apply_matches_transformers(
    hf_rotary: DeepseekV4RotaryEmbedding, layer_type: str, theta: float, yarn: Yarn | None
) -> None:
    t, h = 12, 3
    x = _x((t, h, HEAD_DIM))
    positions = _positions(t)
    cos, sin = hf_rotary(x, positions[None], layer_type=layer_type)
    expected = apply_rotary_pos_emb(x.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)
    inv_freq = rope_inv_freq(ROPE_DIM, theta, yarn)
    torch.testing.assert_close(apply_rope_ref(x, positions, inv_freq), expected)
    torch.testing.assert_close(apply_rope_triton(x, positions, inv_freq), expected)


def test_yarn_keeps_fast_pairs_and_slows_down_slow_ones() -> None:
    plain, scaled = rope_inv_freq(64, 160000.0), rope_inv_freq(64, 160000.0, TOY_YARN)

    def corr(beta: float) -> float:
        return 64 * math.log(65536 / (2 * math.pi * beta)) / (2 * math.log(160000.0))

    low, high = math.floor(corr(32)), math.ceil(corr(1))
    assert torch.equal(scaled[:low], plain[:low])
    torch.testing.assert_close(scaled[high:], plain[high:] / 16)
    assert torch.all(scaled[low:high] <= plain[low:high]) and torch.all(
        scaled[low:high] >= plain[low:high] / 16
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("shape", "pairs"),
    [((7, 64), 8), ((5, 3, 64), 8), ((1, 576), 32), ((4, 2, 16), 8), ((6, 2, 30), 4), ((0, 4, 64), 8)],
    ids=["2d", "3d", "single-token-v4-head", "rope-only", "odd-nope", "empty"],
)
def test_kernel_matches_reference(shape: tuple[int, ...], pairs: int, dtype: torch.dtype) -> None:
    x, positions = _x(shape, dtype), _positions(shape[0])
    inv_freq = rope_inv_freq(2 * pairs, 160000.0, TOY_YARN)
    for inverse in (False, True):
        out = apply_rope_triton(x, positions, inv_freq, inverse)
        assert out.shape == x.shape and out.dtype == dtype
        torch.testing.assert_close(out, apply_rope_ref(x, positions, inv_freq, inverse))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [False, True], ids=["head-norm", "key-norm"])
@pytest.mark.parametrize(
    ("shape", "pairs"), [((7, 64), 8), ((5, 3, 600), 32), ((4, 2, 16), 8)], ids=["2d", "3d-wide", "rope-only"]
)
def test_norm_then_rope_matches_the_two_references(
    shape: tuple[int, ...], pairs: int, weighted: bool, dtype: torch.dtype
) -> None:
    """The fused norm: the norm's output rounded to the dtype of x, then rotated; a row wider than a
    NoPE sub-tile (600) sums its squares over several."""
    x, positions = _x(shape, dtype) * 3, _positions(shape[0])
    inv_freq = rope_inv_freq(2 * pairs, 10000.0)
    weight = torch.rand(shape[-1], generator=torch.Generator().manual_seed(3)) + 0.5 if weighted else None
    out = apply_rope_triton(x, positions, inv_freq, False, 1e-6, weight)
    normed = rms_norm_ref(x, weight, 1e-6)
    want = apply_rope_ref(normed, positions, inv_freq)
    assert torch.equal(apply_rope_ref(x, positions, inv_freq, False, 1e-6, weight), want)
    # fp32: the sums of squares in another order. bf16 rounds twice (the norm's output, the rotation), and
    # the interpreter truncates where devices round to nearest: up to two bf16 ulps apart.
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2**-6, "atol": 2**-6}
    torch.testing.assert_close(out.float(), want.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope_fn", [apply_rope_ref, apply_rope_triton], ids=["ref", "triton"])
def test_keys_are_stored_as_they_are_rotated(rope_fn, dtype: torch.dtype) -> None:
    """The rows returned are the rows stored at their slots (-1: not stored); every other slot keeps its
    row, in both the NoPE and the rope channels (a row wider than a NoPE sub-tile: 600)."""
    x, positions, inv_freq = _x((6, 600), dtype) * 3, _positions(6), rope_inv_freq(64, 10000.0)
    weight = torch.rand(600, generator=torch.Generator().manual_seed(4)) + 0.5
    cache = _x((10, 600), dtype, seed=5)
    before, slots = cache.clone(), torch.tensor([7, -1, 0, 3, -1, 9], dtype=torch.int32)
    out = rope_fn(x, positions, inv_freq, False, 1e-6, weight, cache, slots)
    assert torch.equal(out, rope_fn(x, positions, inv_freq, False, 1e-6, weight))
    kept = slots >= 0
    assert torch.equal(cache[slots[kept].long()], out[kept])
    untouched = torch.ones(10, dtype=torch.bool)
    untouched[slots[kept].long()] = False
    assert torch.equal(cache[untouched], before[untouched])


def test_a_stored_rotation_is_validated() -> None:
    x, positions, inv_freq = _x((2, 16)), _positions(2), torch.ones(4)
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="cache / slots: give both or neither"):
        apply_rope(x, positions, inv_freq, cache=torch.zeros(4, 16))
    with pytest.raises(
        ValueError, match=r"x: torch.float32 \(2, 16\) must be \[T, D\] of the cache's torch.bfloat16"
    ):
        apply_rope(x, positions, inv_freq, cache=torch.zeros(4, 16, dtype=torch.bfloat16), slots=slots)
    with pytest.raises(ValueError, match=r"x: torch.float32 \(2, 1, 16\) must be \[T, D\]"):
        apply_rope(x[:, None], positions, inv_freq, cache=torch.zeros(4, 16), slots=slots)
    with pytest.raises(ValueError, match=r"pool: torch.float32 \(4, 8\) must be \[num_slots, 16\]"):
        apply_rope(x, positions, inv_freq, cache=torch.zeros(4, 8), slots=slots)


def test_norm_weight_needs_eps() -> None:
    with pytest.raises(ValueError, match="norm_weight: given without norm_eps"):
        apply_rope(_x((2, 16)), _positions(2), torch.ones(4), norm_weight=torch.ones(16))
    with pytest.raises(ValueError, match=r"weight: shape \(8,\) must be \(16,\)"):
        apply_rope(_x((2, 16)), _positions(2), torch.ones(4), norm_eps=1e-6, norm_weight=torch.ones(8))


@settings(max_examples=10, deadline=None)
@given(
    t=st.integers(1, 20),
    heads=st.integers(1, 5),
    pairs=st.integers(1, 12),
    nope=st.integers(0, 40),
    pos_dtype=st.sampled_from([torch.int32, torch.int64]),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_reference_random(
    t: int, heads: int, pairs: int, nope: int, pos_dtype: torch.dtype, seed: int
) -> None:
    x = _x((t, heads, nope + 2 * pairs), seed=seed)
    positions = _positions(t, seed).to(pos_dtype)
    inv_freq = rope_inv_freq(2 * pairs, 10000.0)
    torch.testing.assert_close(
        apply_rope_triton(x, positions, inv_freq), apply_rope_ref(x, positions, inv_freq)
    )


@pytest.mark.parametrize("rope_fn", [apply_rope_ref, apply_rope_triton], ids=["ref", "triton"])
def test_inverse_undoes_forward_and_nope_is_untouched(rope_fn) -> None:
    x, positions = _x((9, 2, HEAD_DIM)), _positions(9)
    inv_freq = rope_inv_freq(ROPE_DIM, 160000.0, TOY_YARN)
    rotated = rope_fn(x, positions, inv_freq)
    assert torch.equal(rotated[..., : HEAD_DIM - ROPE_DIM], x[..., : HEAD_DIM - ROPE_DIM])
    assert not torch.allclose(rotated[..., -ROPE_DIM:], x[..., -ROPE_DIM:])
    torch.testing.assert_close(rope_fn(rotated, positions, inv_freq, inverse=True), x, rtol=1e-5, atol=1e-5)


def test_pairs_are_interleaved() -> None:
    x = torch.zeros(1, 4)
    x[0, 0] = 1.0  # real part of pair 0 only
    out = apply_rope_ref(x, torch.tensor([1]), torch.tensor([math.pi / 2, 0.0]))
    torch.testing.assert_close(out, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))


def test_public_op_dispatches(monkeypatch: pytest.MonkeyPatch) -> None:
    x, positions = _x((3, 2, 32)), _positions(3)
    inv_freq = rope_inv_freq(16, 10000.0)
    assert torch.equal(apply_rope(x, positions, inv_freq), apply_rope_ref(x, positions, inv_freq))
    monkeypatch.setattr(runtime, "use_triton", lambda t: True)
    torch.testing.assert_close(apply_rope(x, positions, inv_freq), apply_rope_ref(x, positions, inv_freq))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (
            (torch.zeros(2, 8, dtype=torch.float16), torch.zeros(2, dtype=torch.long), torch.ones(2)),
            "x: dtype",
        ),
        ((torch.zeros(8), torch.zeros(1, dtype=torch.long), torch.ones(2)), "x: shape"),
        ((torch.zeros(2, 8), torch.zeros(2, dtype=torch.long), torch.ones(5)), "inv_freq: 5 pairs"),
        (
            (torch.zeros(2, 8), torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.float64)),
            "inv_freq: ",
        ),
        ((torch.zeros(2, 8), torch.zeros(2), torch.ones(2)), "positions: dtype"),
        ((torch.zeros(2, 8), torch.zeros(3, dtype=torch.long), torch.ones(2)), r"positions: shape \(3,\)"),
        (
            (torch.zeros(2, 8), torch.zeros(2, dtype=torch.long, device="meta"), torch.ones(2)),
            "positions: device",
        ),
    ],
)
def test_apply_validation(args: tuple[torch.Tensor, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        apply_rope(*args)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: rope_inv_freq(15, 10000.0), "rope_dim: 15"),
        (lambda: rope_inv_freq(16, 1.0), "theta: 1.0"),
        (lambda: Yarn(0, 65536, 32, 1), "factor: 0"),
        (lambda: Yarn(16, 0, 32, 1), "original_max_position_embeddings: 0"),
        (lambda: Yarn(16, 65536, 1, 32), "beta_fast, beta_slow: 1, 32"),
    ],
)
def test_frequency_validation(make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_empty_input_does_not_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rope, "_rope_tuned", None)  # any launch would fail
    out = apply_rope_triton(torch.zeros(0, 2, 16), torch.zeros(0, dtype=torch.long), torch.ones(4))
    assert out.shape == (0, 2, 16)
