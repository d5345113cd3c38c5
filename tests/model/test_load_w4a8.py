"""W4A8 (msModelSlim ``W4A8_DYNAMIC`` routed experts, model-spec §9.5): the checkpoint loads as stored
(int4 bytes resident, stacked for ``moe_gemm``), runs close to its own fp32-dequantised form and to the fp32
model it was quantised from, and a scale of the wrong shape or a missing ``scale_bias`` is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.checkpoint import DESCRIPTION_FILE, SLIM_SINGLE_FILE, load_model, stored_tensors
from model.testing.release_like import to_msmodelslim
from model.testing.tiny import write_tiny
from tests.model.test_load_w8a8 import MEAN_COSINE, MEDIAN_COSINE, TOP1, _agreement, _copy

# Against its own dequantised form only the activations differ (int8 per token, at every W8A8 / W4A8
# GEMM), as in the W8A8 test: the same floors hold (measured: cosine mean 0.998, top-1 0.94). Against
# the fp32 model it was quantised from, per-channel int4 experts add a rounding step of amax / 7 (about
# 11 % of a weight's spread per GEMM, three GEMMs per expert, six layers of random tiny weights): measured
# on 64 tokens, W8A8 cosine mean 0.992 / top-1 0.89, W4A8 0.883 / 0.41. Swapped nibbles (outputs 2j and
# 2j + 1 exchanged) measure 0.15 / 0.0, so the W4A8 floors sit between: below the measured value by the
# margin routing flips take, far above a layout error.
SOURCE_FLOORS = {"msmodelslim": (MEAN_COSINE, TOP1), "msmodelslim-w4a8": (0.8, 0.25)}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("w4a8")
    dense = write_tiny(root / "dense")
    return dense, to_msmodelslim(dense, root / "w4a8", layout="msmodelslim-w4a8")


def test_w4a8_checkpoint_loads_as_stored_and_runs(dirs):
    _, path = dirs
    model = load_model(path)
    experts = model.layers[0].ffn.experts
    assert experts.format == "int4" and experts.w1.dtype == torch.int8
    assert experts.w1.shape == (8, 32, 128)  # [E, I / 2, D]: two outputs per byte
    stored = stored_tensors(path)
    resident = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert resident == sum(t.nbytes for t in stored.values())
    state = model.official_state()
    for name in ("layers.2.ffn.experts.5.w2.weight", "layers.2.ffn.experts.5.w2.scale_bias"):
        assert torch.equal(state[name], stored[name].read()), name
    mean, median, top1 = _agreement(model, load_model(path, quantization="dense"))
    assert mean >= MEAN_COSINE and median >= MEDIAN_COSINE and top1 >= TOP1


def test_w4a8_requantised_to_w8a8_at_load(dirs):
    _, path = dirs
    model = load_model(path, quantization="w8a8")
    assert model.layers[0].ffn.experts.format == "int8"
    mean, median, top1 = _agreement(model, load_model(path, quantization="dense"))
    assert mean >= MEAN_COSINE and median >= MEDIAN_COSINE and top1 >= TOP1


@pytest.mark.parametrize("layout", ["msmodelslim", "msmodelslim-w4a8"])
def test_quantised_against_the_fp32_source(dirs, tmp_path, layout):
    dense, _ = dirs
    path = to_msmodelslim(dense, tmp_path / layout, layout=layout)
    mean, _, top1 = _agreement(load_model(path), load_model(dense))
    print(f"{layout} vs fp32: cosine mean {mean:.4f}, top-1 {top1:.3f}")
    cosine_floor, top1_floor = SOURCE_FLOORS[layout]
    assert mean >= cosine_floor and top1 >= top1_floor


def _edited(src, dst, edit):
    bad = _copy(src, dst)
    tensors = load_file(bad / SLIM_SINGLE_FILE)
    description = json.loads((bad / DESCRIPTION_FILE).read_text())
    edit(tensors, description)
    save_file(tensors, bad / SLIM_SINGLE_FILE)
    (bad / DESCRIPTION_FILE).write_text(json.dumps(description))
    return bad


W1_SCALE = "layers.1.ffn.experts.2.w1.weight_scale"
W2_BIAS = "layers.1.ffn.experts.2.w2.scale_bias"


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda t, d: t.update({W1_SCALE: t[W1_SCALE][:32]}),
            rf"{W1_SCALE}: shape \(32, 1\) does not fit int4",
        ),
        (lambda t, d: t.pop(W2_BIAS), f"names tensor {W2_BIAS}, which no shard"),
        (
            lambda t, d: (t.pop(W2_BIAS), d.pop(W2_BIAS)),
            r"experts\.2\.w2\.weight: W4A8_DYNAMIC needs an int8 weight with .* \.scale_bias",
        ),
        (
            lambda t, d: t.update({W2_BIAS: t[W2_BIAS][:, :3].contiguous()}),
            rf"{W2_BIAS}: shape \(128, 3\) does not fit",
        ),
    ],
    ids=["scale-shape", "scale_bias-missing", "scale_bias-undescribed", "scale_bias-shape"],
)
def test_bad_w4a8_input_is_refused_by_name(dirs, tmp_path, edit, match):
    with pytest.raises(ValueError, match=match):
        load_model(_edited(dirs[1], tmp_path / "bad", edit))
