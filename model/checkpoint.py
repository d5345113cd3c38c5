"""Load a checkpoint in the official naming: single or sharded safetensors, FP8 dequantised on load.

Loading is strict: a missing, unexpected or mis-shaped tensor is an error that lists every name. The
one exception: a checkpoint with no draft tensors at all (``mtp.*``: transformers drops them, some
copies strip them) loads as the backbone alone, with speculative decoding unavailable.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from model.config import ModelConfig
from model.deepseek_v4 import DeepseekV4
from model.deepseek_v41 import DeepseekV41
from model.engram import compressed_token_map
from model.quant import dequantize_fp4, dequantize_fp8
from model.tokenizer import load_tokenizer
from triton_kernels import runtime

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DRAFT_PREFIX = "mtp."
COMPUTE_DTYPES = (torch.float32, torch.bfloat16)
DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float": torch.float32}
DEVICES = ("npu", "cuda", "cpu")
_TEXT_ONLY_SKIPS = re.compile(r"(\.gate\.bias_vl(\.|$)|^(vision|aligner)\.|^image_(start|newline|end)\b)")
_FP4 = re.compile(r"\.experts\.\d+\.w[123]\.weight$")  # routed experts: packed E2M1 codes
# Kept in fp32 whatever the compute dtype (model-spec §9.1): mHC, sinks, compressor position bias, gate
# bias; and the norm weights (Engram's q/k norms too), stored bf16 but applied in fp32, so exact in fp32.
_FP32 = re.compile(r"(hc_\w+|attn_sink|\.ape|gate\.bias|norm\.weight|engram\.[qk]_weight)$")


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder, as stored."""
    path = Path(path)
    if (path / INDEX_FILE).exists():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (path / SINGLE_FILE).exists():
        files = [SINGLE_FILE]
    else:
        raise ValueError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(path / file, framework="pt") as f:
            for name in f.keys():
                if name in tensors:
                    raise ValueError(f"tensor {name} appears in more than one shard")
                tensors[name] = f.get_tensor(name)
    return tensors


def dequantize(
    tensors: dict[str, torch.Tensor], block: int | None, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Fold each FP8 or MXFP4 ``X.weight`` with its ``X.scale`` into one ``dtype`` weight."""
    return {name: unpack(name, tensors, block, dtype) for name in weight_names(tensors)}


def weight_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The names a model loads: every tensor but the ``.scale`` siblings of quantised weights."""
    return [
        n for n in tensors if not (n.endswith(".scale") and n.removesuffix(".scale") + ".weight" in tensors)
    ]


def unpack(
    name: str, tensors: dict[str, torch.Tensor], block: int | None, dtype: torch.dtype
) -> torch.Tensor:
    """Tensor ``name`` as the model holds it: FP8 / MXFP4 expanded with its scale straight to ``dtype``,
    other floating tensors in ``dtype`` except those model-spec §9.1 keeps in fp32."""
    t = tensors[name]
    if t.dtype == torch.int8 and _FP4.search(name):
        scale = tensors.get(name.removesuffix(".weight") + ".scale")
        if scale is None:
            raise ValueError(f"FP4 tensor {name} has no sibling .scale")
        return dequantize_fp4(t, scale, dtype)
    if t.dtype == torch.float8_e4m3fn:
        scale = tensors.get(name.removesuffix(".weight") + ".scale")
        if scale is None or block is None:
            raise ValueError(
                f"FP8 tensor {name} has no sibling .scale or the config has no "
                "quantization_config.weight_block_size"
            )
        return dequantize_fp8(t, scale, block, dtype)
    return t.to(parameter_dtype(name, dtype)) if t.is_floating_point() else t


def parameter_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the model keeps official tensor ``name`` in when it computes in ``dtype``."""
    return torch.float32 if _FP32.search(name) else dtype


def unpacked_shape(name: str, tensors: dict[str, torch.Tensor]) -> tuple[int, ...]:
    """The shape ``unpack`` gives, read from the stored tensor alone (two E2M1 codes per FP4 byte)."""
    t = tensors[name]
    if t.dtype == torch.int8 and _FP4.search(name):
        return (*t.shape[:-1], t.shape[-1] * 2)
    return tuple(t.shape)


def build_model(cfg: ModelConfig, path: str | Path) -> DeepseekV4 | DeepseekV41:
    """The model of ``cfg``, on ``meta``: V4.1 Engram needs the checkpoint's tokenizer."""
    token_map = None
    if cfg.is_v41 and cfg.engram_layer_ids:
        token_map, _ = compressed_token_map(load_tokenizer(path))
    with torch.device("meta"):
        return DeepseekV41(cfg, token_map) if cfg.is_v41 else DeepseekV4(cfg)


def placement(
    device: str | None = None, dtype: str | torch.dtype = "auto"
) -> tuple[torch.device, torch.dtype]:
    """Where and in what the model computes: ``device`` one of DEVICES (None: the one present) and
    ``dtype`` auto (bf16 on npu / cuda, fp32 on cpu), bfloat16 or float32 (names or torch dtypes)."""
    present = runtime.backend()
    device = device or present
    if device not in DEVICES:
        raise ValueError(f"device={device!r}: one of {', '.join(DEVICES)}")
    if device not in ("cpu", present):
        raise ValueError(f"device={device!r}: this machine has no {device} device (found: {present})")
    name = str(dtype).removeprefix("torch.")
    if name == "auto":
        return torch.device(device), torch.float32 if device == "cpu" else torch.bfloat16
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype={name!r}: the model computes in bfloat16 or float32 (or auto), not {name}")
    return torch.device(device), DTYPE_NAMES[name]


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> DeepseekV4 | DeepseekV41:
    """The checkpoint's model on ``device``, computing in ``dtype`` (fp32 or bf16; the tensors of
    model-spec §9.1 stay fp32). Tensors are expanded and copied in one at a time, each stored tensor
    dropped once copied, so no second full-precision copy of the model is held."""
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype={dtype}: the model computes in {' or '.join(map(str, COMPUTE_DTYPES))}")
    cfg = ModelConfig.from_file(path)
    tensors = _drop_unused(read_tensors(path))
    if cfg.num_draft_layers and not any(name.startswith(DRAFT_PREFIX) for name in tensors):
        cfg = cfg.without_drafts()
    model = build_model(cfg, path)
    names = weight_names(tensors)
    check_names(model.checkpoint_names(), {name: unpacked_shape(name, tensors) for name in names})
    for name, param in model.named_parameters():
        param.data = param.data.to(parameter_dtype(name, dtype))  # still on meta: no bytes yet
    model = model.to_empty(device=device)
    targets = model.official_state()
    with torch.no_grad():
        for name in names:
            targets[name].copy_(unpack(name, tensors, cfg.fp8_block, targets[name].dtype))
            del tensors[name]  # its stored bytes go now; the scales stay for their siblings
    model.init_buffers()
    return model.requires_grad_(False).eval()  # inference only


def _drop_unused(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors a text-only build never uses: the image-token gate bias and the vision tower."""
    return {n: t for n, t in tensors.items() if not _TEXT_ONLY_SKIPS.search(n)}


def check_names(expected: dict[str, tuple[int, ...]], shapes: dict[str, tuple[int, ...]]) -> None:
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    misshaped = sorted(
        f"{n} {shapes[n]} != {expected[n]}" for n in set(expected) & set(shapes) if shapes[n] != expected[n]
    )
    problems = [
        f"{label}: {', '.join(names)}"
        for label, names in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped))
        if names
    ]
    if problems:
        raise ValueError("checkpoint does not match the model; " + "; ".join(problems))
