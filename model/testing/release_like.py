"""Width-faithful synthetic checkpoints: a release's widths, dtypes, names, sharding and index with few
layers and experts and random values, for loader tests and memory benchmarks (not for numerics).

``official`` is the release layout (model-spec §9.1, §10): FP8 E4M3 linears with E8M0 128 x 128 block
scales, MXFP4 routed experts, bf16 embeddings / head / norms / router, fp32 mHC / sinks / ``ape`` / gate
bias, one shard per layer. ``msmodelslim`` is the Ascend W8A8 layout of model-spec §9.5: int8 weights
with fp32 ``weight_scale`` / ``weight_offset`` where msModelSlim quantises, bf16 elsewhere, the
``quant_model_description.json`` naming each tensor's type and ``quant_model_weights*`` shards.
``msmodelslim-w4a8`` is the same with the routed experts in W4A8 (V4-Pro's layout): int4 codes packed two
per byte along the output dimension (``weight [out/2, in]`` int8, output ``2j`` in the low nibble of
byte row ``j``), fp32 ``weight_scale`` / ``weight_offset`` ``[out, 1]`` and ``scale_bias`` (``[out, 1]``
for ``w1`` / ``w3``, ``[out, 16]`` for ``w2``). Tensors are written shard by shard, so the writer's
memory is one layer, not the model.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from model.config import ModelConfig
from model.deepseek_v4 import DeepseekV4
from model.quant_linear import BIAS_COLUMNS
from model.testing.tiny import FP8_CONFIG, TOY_V4
from model.tokenizer import write_tokenizer
from triton_kernels.quant import quantize_int8_ref

# The releases' widths (model-spec §2): heads, head and rope dims, ranks, Engram heads, all that shapes a
# kernel's tiles. The toys follow the releases in everything else.
V4_FLASH_WIDTHS = {
    "hidden_size": 4096,
    "num_attention_heads": 64,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "moe_intermediate_size": 2048,
}
V41_FLASH_WIDTHS = {
    **V4_FLASH_WIDTHS,
    "hidden_size": 5120,
    "q_lora_rank": 1280,
    "index_n_heads": 32,
    "moe_intermediate_size": 2304,
    "candidate_topk_blocks": 2048,
    "candidate_block_size": 8,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
}
V4_FLASH = {
    **TOY_V4,
    **V4_FLASH_WIDTHS,
    "dtype": "bfloat16",
    "vocab_size": 129280,
    "sliding_window": 128,
    "num_experts_per_tok": 6,
    "quantization_config": {**FP8_CONFIG, "weight_block_size": [128, 128]},
}
LIKES = {"v4-flash": V4_FLASH}
LAYOUTS = ("official", "msmodelslim", "msmodelslim-w4a8")
DESCRIPTION_FILE = "quant_model_description.json"
_FP4 = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
_FP8 = re.compile(
    r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|indexer\.wq_b|shared_experts\.w[123]|[eh]_proj)\.weight$"
)
# msModelSlim's W8A8 set (model-spec §9.5): wo_a / wo_b and everything unquantised stay bf16.
_W8A8 = re.compile(r"\.(attn\.(wq_a|wq_b|wkv)|indexer\.wq_b|(shared_)?experts\.(\d+\.)?w[123])\.weight$")
_FP32 = re.compile(r"(hc_\w+|attn_sink|\.ape|gate\.bias)$")
_W2 = re.compile(r"\.w2\.weight$")
INT4_MAX = 7  # symmetric int4: codes in [-7, 7]


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes ``[out, in]`` (out even) -> bytes ``[out/2, in]``: output ``2j`` low nibble, ``2j+1``
    high."""
    return ((codes[0::2] & 15) | (codes[1::2] << 4)).to(torch.int8)


def int4_parts(name: str, codes: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """A W4A8 weight and its siblings from its int4 codes ``[out, in]`` and scales ``[out]``.

    ``scale_bias`` is what Ascend's grouped W4A8 matmul adds back for the +8 shift it applies to the
    activations' low half: ``8 * s_w[n] * sum_k q[n, k]``, split in column slices for ``w2`` (vLLM-Ascend
    sums them). Our kernels compute the int8 x int4 product directly and never read it."""
    slices = BIAS_COLUMNS[1] if _W2.search(name) else BIAS_COLUMNS[0]
    sums = torch.stack([part.sum(-1) for part in codes.float().tensor_split(slices, dim=1)], dim=1)
    bias = 8 * scale[:, None] * sums
    return {**int8_parts(name, pack_int4(codes), scale), f"{name.removesuffix('.weight')}.scale_bias": bias}


def int8_parts(name: str, q: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """A W8A8 weight (or W4A8's packed bytes) with its fp32 ``weight_scale`` and zero ``weight_offset``."""
    base = name.removesuffix(".weight")
    channels = scale.reshape(-1, 1).float()
    return {name: q, f"{base}.weight_scale": channels, f"{base}.weight_offset": torch.zeros_like(channels)}


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int4: ``scale = amax / 7``, codes rounded half away from zero."""
    scale = w.float().abs().amax(dim=-1) / INT4_MAX
    y = w.float() / scale.clamp_min(1e-30)[:, None]
    return (torch.sign(y) * torch.floor(y.abs() + 0.5)).clamp(-INT4_MAX, INT4_MAX).to(torch.int8), scale


def like_config(like: str, layers: int, experts: int) -> dict:
    """The release config with ``layers`` backbone layers alternating CSA (4) and HCA (128), one hash-
    routed layer first, one MTP layer, and ``experts`` routed experts."""
    if like not in LIKES:
        raise ValueError(f"like={like!r}: one of {', '.join(LIKES)}")
    if layers < 2 or experts < LIKES[like]["num_experts_per_tok"]:
        raise ValueError(f"layers={layers}, experts={experts}: at least 2 layers and top-k experts")
    ratios = ([4, 128] * layers)[:layers] + [0]
    return {
        **LIKES[like],
        "num_hidden_layers": layers,
        "compress_ratios": ratios,
        "num_hash_layers": 1,
        "n_routed_experts": experts,
    }


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype).normal_(0.0, 1.0 / math.sqrt(shape[-1]), generator=gen)


def _codes(shape: tuple[int, ...], gen: torch.Generator, low: int = 0) -> torch.Tensor:
    codes = torch.randint(low, 256, shape, dtype=torch.uint8, generator=gen)
    return torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)  # no E4M3 NaN


def _exponents(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randint(118, 121, shape, dtype=torch.uint8, generator=gen).view(torch.float8_e8m0fnu)


def stored(
    name: str, shape: tuple[int, ...], layout: str, experts: int, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """Tensor ``name`` (dense shape ``shape``) and its scale siblings as ``layout`` stores them."""
    base = name.removesuffix(".weight")
    out, cols = shape[0], shape[-1]
    if layout == "msmodelslim-w4a8" and _FP4.search(name):
        codes = torch.randint(-INT4_MAX, INT4_MAX + 1, shape, dtype=torch.int8, generator=gen)
        return int4_parts(name, codes, torch.rand(out, generator=gen) * 1e-2 + 1e-3)
    if layout.startswith("msmodelslim") and _W8A8.search(name):
        return int8_parts(
            name, _codes(shape, gen).view(torch.int8), torch.rand(out, generator=gen) * 1e-3 + 1e-4
        )
    if layout == "official" and _FP4.search(name):
        packed = _codes((out, cols // 2), gen).view(torch.int8)
        return {name: packed, f"{base}.scale": _exponents((out, -(-cols // 32)), gen)}
    if layout == "official" and _FP8.search(name):
        block = (-(-out // 128), -(-cols // 128))
        return {name: _codes(shape, gen).view(torch.float8_e4m3fn), f"{base}.scale": _exponents(block, gen)}
    if name.endswith("tid2eid"):
        return {name: torch.randint(0, experts, shape, generator=gen)}
    dtype = torch.float32 if _FP32.search(name) else torch.bfloat16
    return {name: _random(shape, dtype, gen)}


def write_like(out: str | Path, like: str = "v4-flash", layers: int = 2, experts: int = 16,
               layout: str = "official", seed: int = 0) -> Path:  # fmt: skip
    """Write the synthetic checkpoint: one shard per backbone / draft layer, one for the rest."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: one of {', '.join(LAYOUTS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw = like_config(like, layers, experts)
    cfg = ModelConfig.from_dict(raw)
    with torch.device("meta"):
        shapes = DeepseekV4(cfg).checkpoint_names()
    groups: dict[str, list[str]] = {}
    for name in sorted(shapes):
        key = re.match(r"^(layers\.\d+|mtp\.\d+)\.", name)
        groups.setdefault(key[1] if key else "global", []).append(name)
    gen = torch.Generator().manual_seed(seed)
    slim = layout.startswith("msmodelslim")
    prefix = "quant_model_weights" if slim else "model"
    weight_map, description, total = {}, {}, 0
    for i, names in enumerate(groups.values()):
        file = f"{prefix}-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in names:
            parts = stored(name, shapes[name], layout, experts, gen)
            description.update(dict.fromkeys(parts, slim_type(parts)))
            tensors.update(parts)
        save_file(tensors, out / file)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / f"{prefix}.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    if slim:
        del raw["quantization_config"]
        _describe(out, description, layout)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return out


def slim_type(parts: dict[str, torch.Tensor]) -> str:
    """msModelSlim's type of a weight and its siblings: int8 with a ``scale_bias`` is W4A8."""
    if any(n.endswith(".scale_bias") for n in parts):
        return "W4A8_DYNAMIC"
    return "W8A8_DYNAMIC" if next(iter(parts.values())).dtype == torch.int8 else "FLOAT"


def _describe(out: Path, description: dict[str, str], layout: str) -> None:
    kind = "W4A8_DYNAMIC" if layout == "msmodelslim-w4a8" else "W8A8_DYNAMIC"
    meta = {"version": "1.0.0", "model_quant_type": kind, "group_size": 0, "metadata": {}}
    (out / DESCRIPTION_FILE).write_text(json.dumps({**meta, **description}, indent=1) + "\n")


def to_msmodelslim(src: str | Path, out: str | Path, layout: str = "msmodelslim") -> Path:
    """A small dense checkpoint (``tiny``) rewritten in an msModelSlim layout: msModelSlim's W8A8 set as
    symmetric int8 with per-channel scales (with ``msmodelslim-w4a8`` the routed experts as int4),
    the rest as stored (no QuaRot rotation: the result is checked against its own dequantised form, as
    model-spec §9.5 says)."""
    if layout not in LAYOUTS[1:]:
        raise ValueError(f"layout={layout!r}: one of {', '.join(LAYOUTS[1:])}")
    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors, description = {}, {}
    for name, t in load_file(src / "model.safetensors").items():
        if layout == "msmodelslim-w4a8" and _FP4.search(name):
            parts = int4_parts(name, *quantize_int4(t))
        elif _W8A8.search(name):
            q, scale = quantize_int8_ref(t)
            parts = int8_parts(name, q, scale)
        else:
            parts = {name: t}
        description.update(dict.fromkeys(parts, slim_type(parts)))
        tensors.update(parts)
    save_file(tensors, out / "quant_model_weights.safetensors")
    _describe(out, description, layout)
    raw = json.loads((src / "config.json").read_text())
    raw.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    write_tokenizer(out)
    return out
