"""The packed layer family: each format equals dequantise-then-dense, and whole tiny checkpoints keep their
stored bytes resident and give the logits of the dense load within fp32 rounding."""

from __future__ import annotations

import pytest
import torch

from model.checkpoint import load_model, stored_tensors
from model.quant import dequantize_fp4, dequantize_fp8, quantize_fp4, quantize_fp8
from model.quant_linear import DenseLinear, Fp8Linear, Int8Linear, Mxfp4Linear, stack_rows
from model.testing.tiny import write_tiny
from triton_kernels.quant import dequantize_int8, quantize_int8_ref


def _layers(block: int = 32) -> list[tuple[torch.nn.Module, torch.Tensor]]:
    """Each packed layer [96, 64] filled from one random weight, with that weight dequantised."""
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))
    fp8, fp4, int8 = Fp8Linear(64, 96, block), Mxfp4Linear(64, 96), Int8Linear(64, 96)
    fp8.weight, fp8.scale = quantize_fp8(w, block)
    fp4.weight, fp4.scale = quantize_fp4(w)
    q, s = quantize_int8_ref(w)
    int8.weight, int8.weight_scale, int8.weight_offset = q, s[:, None], torch.zeros(96, 1)
    return [
        (fp8, dequantize_fp8(fp8.weight, fp8.scale, block, torch.float32)),
        (fp4, dequantize_fp4(fp4.weight, fp4.scale, torch.float32)),
        (int8, q.float() * s[:, None]),
    ]


@pytest.mark.parametrize("index", range(3), ids=["fp8", "mxfp4", "int8"])
def test_each_format_equals_dequantise_then_dense(index):
    layer, dense_weight = _layers()[index]
    dense = DenseLinear(64, 96)
    dense.weight.data = dense_weight
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(1))
    # W8A8 quantises the activations per token too: the dense reference sees the same rounded x.
    x_ref = dequantize_int8(*quantize_int8_ref(x)) if isinstance(layer, Int8Linear) else x
    with torch.no_grad():
        packed = layer(x)
        torch.testing.assert_close(packed, dense(x_ref), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.grouped(x), dense.grouped(x_ref), rtol=1e-5, atol=1e-5)
    assert packed.shape == (5, 3, 96)


def _pair(index: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Two linears of one format over one input, filled from different weights."""
    if index == 3:
        dense = [DenseLinear(64, rows) for rows in (96, 40)]
        for i, layer in enumerate(dense):
            layer.weight.data = torch.randn(layer.weight.shape, generator=torch.Generator().manual_seed(i))
        return dense[0], dense[1]
    first, second = _layers()[index][0], _layers()[index][0]
    for t in second.buffers():
        t.copy_(t.flip(0))  # other rows (whole scale blocks move with their rows)
    return first, second


@pytest.mark.parametrize("index", range(4), ids=["fp8", "mxfp4", "int8", "dense"])
def test_stacked_rows_give_each_linear_its_output_from_one_gemm(index):
    """The linears' outputs from one GEMM over their stacked rows; their tensors become views of the
    stacked ones (a load into them fills it), and the state dict keeps only their own names."""
    first, second = _pair(index)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = first(x), second(x)
        names = {**first.state_dict(), **{f"b.{k}": v for k, v in second.state_dict().items()}}.keys()
        stacked = stack_rows(first, second)
        outs = stacked(x)
    for out, want in zip(outs, expected, strict=True):
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    joint = {t.untyped_storage().data_ptr() for t in stacked.joint.state_dict().values()}
    for layer in (first, second):
        assert {t.untyped_storage().data_ptr() for t in layer.state_dict().values()} <= joint
    assert stacked.state_dict() == {}
    assert {**first.state_dict(), **{f"b.{k}": v for k, v in second.state_dict().items()}}.keys() == names


def test_rows_that_cannot_stack_stay_apart():
    fp8 = _layers()[0][0]
    assert stack_rows(Fp8Linear(64, 16, 32), fp8) is None  # 16 rows would split a block of scales
    assert stack_rows(fp8, DenseLinear(64, 32)) is None  # two formats
    assert stack_rows(DenseLinear(64, 32), DenseLinear(48, 32)) is None  # two inputs


def test_fp8_rows_must_start_on_a_block():
    layer, _ = _layers()[0]
    with pytest.raises(ValueError, match="multiple of 32"):
        layer.packed(16, 48)


def _resident_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("fp8"), fp8=True)


def test_packed_checkpoint_keeps_its_stored_bytes(fp8_dir):
    model = load_model(fp8_dir)
    assert isinstance(model.layers[0].attn.wq_a, Fp8Linear)
    assert model.layers[0].ffn.experts.format == "mxfp4"
    assert isinstance(model.layers[0].ffn.shared_experts.w2, Fp8Linear)
    stored = stored_tensors(fp8_dir)
    assert _resident_bytes(model) == sum(t.nbytes for t in stored.values())
    state = model.official_state()
    for name in (
        "layers.3.ffn.experts.5.w2.weight",
        "layers.3.ffn.experts.5.w2.scale",
        "layers.1.attn.wo_a.scale",
    ):
        assert torch.equal(state[name].view(torch.uint8), stored[name].read().view(torch.uint8)), name


@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_packed_logits_equal_the_dense_load(fp8_dir, tmp_path, arch):
    """FP8 linears (the grouped wo_a included) and MXFP4 experts through moe_gemm's reference."""
    path = fp8_dir if arch == "v4" else write_tiny(tmp_path / arch, arch=arch, fp8=True)
    packed, dense = load_model(path), load_model(path, quantization="dense")
    ids = torch.randint(0, packed.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a, b = packed(ids), dense(ids)
        assert (a - b).abs().max() <= 1e-4
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        tokens = ids[:5].tolist()
        greedy = {id(m): list(tokens) for m in (packed, dense)}
        for model in (packed, dense):
            for _ in range(6):
                greedy[id(model)].append(int(model(torch.tensor(greedy[id(model)]), last_only=True).argmax()))
    assert greedy[id(packed)] == greedy[id(dense)]
