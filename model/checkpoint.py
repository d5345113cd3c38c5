"""Load a checkpoint in the official naming (single or sharded safetensors, or msModelSlim's W8A8 / W4A8
layout), streaming, with the weights kept in their stored format.

Loading is strict and happens in two passes. First the shard headers alone: every name, shape and
scale is checked against the model (a missing, unexpected or mis-shaped tensor is an error that lists
every name; a truncated shard or a scale that does not fit its weight names the tensor) and the
linears the checkpoint stores quantised are swapped for packed ones while the model is on ``meta``.
Then the bytes, shard by shard and tensor by tensor, straight into the device tensors: host memory
peaks near one tensor. The one exception to strictness: a checkpoint with no draft tensors at all
(``mtp.*``: transformers drops them, some copies strip them) loads as the backbone alone.

``quantization``: ``auto`` keeps what is stored (FP8 and MXFP4 packed, W8A8 as int8, W4A8 routed
experts as int4); ``dense`` dequantises at load to the compute dtype; ``w8a8`` requantises FP8 / MXFP4 /
int4 to int8 W8A8 (per-output-channel weight scales, model-spec §9.4). The routed experts of every
format are stacked per layer (``StackedExperts``) and run through ``moe_gemm``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

import torch
from torch import nn

from model.causal_lm import CausalLM
from model.config import ModelConfig
from model.deepseek_v4 import DeepseekV4
from model.deepseek_v41 import DeepseekV41
from model.engram import Engram, compressed_token_map
from model.parallel.context import ParallelContext
from model.parallel.sharding import ShardPlan, connect, replace_module, shard_model
from model.quant import dequantize_fp4, dequantize_fp8
from model.quant_linear import BIAS_COLUMNS, DenseLinear, Fp8Linear, Int8Linear, Mxfp4Linear, StackedExperts
from model.shards import StoredTensor, read_headers
from model.tokenizer import load_tokenizer
from triton_kernels import runtime
from triton_kernels.quant import quantize_int8_ref
from triton_kernels.quant_matmul import dequantize_rows, int4_weight

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SLIM_INDEX_FILE = "quant_model_weights.safetensors.index.json"
SLIM_SINGLE_FILE = "quant_model_weights.safetensors"
DESCRIPTION_FILE = "quant_model_description.json"
SLIM_TYPES = ("W8A8_DYNAMIC", "W4A8_DYNAMIC", "FLOAT")
_SLIM_FIELDS = set("version model_quant_type group_size metadata indexer_quant_type kv_cache_type".split())
DRAFT_PREFIX = "mtp."
COMPUTE_DTYPES = (torch.float32, torch.bfloat16)
DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float": torch.float32}
DEVICES = ("npu", "cuda", "cpu")
QUANTIZATIONS = ("auto", "dense", "w8a8")
DENSE, FP8, MXFP4, INT8, INT4 = "dense", "fp8", "mxfp4", "int8", "int4"
SCALE, W8A8_SCALE, W8A8_OFFSET, SCALE_BIAS = ".scale", ".weight_scale", ".weight_offset", ".scale_bias"
_SIBLINGS = (SCALE, W8A8_SCALE, W8A8_OFFSET, SCALE_BIAS)
_SCALE_BIAS_COLUMNS = tuple(sorted(set(BIAS_COLUMNS)))
_TEXT_ONLY_SKIPS = re.compile(r"(\.gate\.bias_vl(\.|$)|^(vision|aligner)\.|^image_(start|newline|end)\b)")
_FP4 = re.compile(r"\.experts\.\d+\.w[123]\.weight$")  # routed experts: packed E2M1 codes
_SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8)
# Kept in fp32 whatever the compute dtype (model-spec §9.1): mHC, sinks, compressor position bias, gate
# bias; and the norm weights (Engram's q/k norms too), stored bf16 but applied in fp32, so exact in fp32.
_FP32 = re.compile(r"(hc_\w+|attn_sink|\.ape|gate\.bias|norm\.weight|engram\.[qk]_weight)$")


def checkpoint_files(path: str | Path) -> tuple[list[Path], dict[str, str] | None]:
    """The shards of a checkpoint folder (official or msModelSlim naming) and its index, if any."""
    path = Path(path)
    for index, single in ((INDEX_FILE, SINGLE_FILE), (SLIM_INDEX_FILE, SLIM_SINGLE_FILE)):
        if (path / index).exists():
            weight_map = json.loads((path / index).read_text())["weight_map"]
            return [path / f for f in sorted(set(weight_map.values()))], weight_map
        if (path / single).exists():
            return [path / single], None
    raise ValueError(f"no {SINGLE_FILE}, {INDEX_FILE} or {SLIM_SINGLE_FILE} in {path}")


def stored_tensors(path: str | Path) -> dict[str, StoredTensor]:
    """Every tensor of a checkpoint folder, from the shard headers (no tensor bytes read)."""
    return read_headers(*checkpoint_files(path))


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder, as stored."""
    return {name: stored.read() for name, stored in stored_tensors(path).items()}


def dequantize(
    tensors: dict[str, torch.Tensor], block: int | None, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Fold each FP8 or MXFP4 ``X.weight`` with its ``X.scale`` into one ``dtype`` weight."""
    return {name: unpack(name, tensors, block, dtype) for name in weight_names(tensors)}


def weight_names(tensors: dict) -> list[str]:
    """The names a dense model loads: every tensor but the scale and offset siblings of quantised weights."""
    return [n for n in tensors if not any(n.endswith(s) and _weight_of(n, s) in tensors for s in _SIBLINGS)]


def _weight_of(sibling: str, suffix: str) -> str:
    return sibling.removesuffix(suffix) + ".weight"


def sibling(name: str, suffix: str) -> str:
    return name.removesuffix(".weight") + suffix


def stored_format(name: str, tensors: dict) -> str:
    """How weight ``name`` is stored: FP8 (E4M3 + ``.scale``), MXFP4 (int8 routed expert + ``.scale``),
    int4 W4A8 (int8 + ``.weight_scale`` + ``.scale_bias``), int8 W8A8 (int8 + ``.weight_scale``) or dense."""
    dtype = tensors[name].dtype
    if dtype == torch.float8_e4m3fn:
        return FP8
    if dtype == torch.int8 and sibling(name, SCALE_BIAS) in tensors:
        return INT4
    if dtype in (torch.int8, torch.uint8) and sibling(name, W8A8_SCALE) in tensors:
        return INT8
    if dtype == torch.int8 and _FP4.search(name):
        return MXFP4
    return DENSE


def unpack(
    name: str, tensors: dict[str, torch.Tensor], block: int | None, dtype: torch.dtype
) -> torch.Tensor:
    """Tensor ``name`` as a dense model holds it: FP8 / MXFP4 / W8A8 expanded with its scale straight to
    ``dtype``, other floating tensors in ``dtype`` except those model-spec §9.1 keeps in fp32."""
    t, fmt = tensors[name], stored_format(name, tensors)
    if fmt == MXFP4:
        return dequantize_fp4(t, tensors[sibling(name, SCALE)], dtype)
    if fmt == FP8:
        return dequantize_fp8(t, tensors[sibling(name, SCALE)], block, dtype)
    if fmt == INT8:
        return (t.float() * tensors[sibling(name, W8A8_SCALE)].float().view(-1, 1)).to(dtype)
    if fmt == INT4:
        return dequantize_rows(int4_weight(t, tensors[sibling(name, W8A8_SCALE)]), 0, 2 * t.shape[0]).to(
            dtype
        )
    return t.to(parameter_dtype(name, dtype)) if t.is_floating_point() else t


def parameter_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the model keeps official tensor ``name`` in when it computes in ``dtype``."""
    return torch.float32 if _FP32.search(name) else dtype


def unpacked_shape(name: str, tensors: dict) -> tuple[int, ...]:
    """The dense shape of weight ``name``, read from the stored tensor alone (two E2M1 codes per FP4 byte)."""
    shape, fmt = tuple(tensors[name].shape), stored_format(name, tensors)
    if fmt == INT4:  # two outputs per byte row
        return (shape[0] * 2, *shape[1:])
    return (*shape[:-1], shape[-1] * 2) if fmt == MXFP4 else shape


def check_scales(tensors: dict, block: int | None) -> None:
    """Every quantised weight has the scales its format needs, of the shape and dtype it needs."""
    for name in weight_names(tensors):
        fmt = stored_format(name, tensors)
        if fmt == DENSE:
            continue
        out, cols = unpacked_shape(name, tensors)
        if fmt == FP8 and block is None:
            raise ValueError(f"FP8 tensor {name}: the config has no quantization_config.weight_block_size")
        b = block or 1
        expected = {
            FP8: {SCALE: [(-(-out // b), -(-cols // b)), (out, -(-cols // b))]},
            MXFP4: {SCALE: [(out, -(-cols // 32))]},
            INT8: {W8A8_SCALE: [(out, 1), (out,)], W8A8_OFFSET: [(out, 1), (out,)]},
            INT4: {
                W8A8_SCALE: [(out, 1), (out,)],
                W8A8_OFFSET: [(out, 1), (out,)],
                SCALE_BIAS: [(out, c) for c in _SCALE_BIAS_COLUMNS],
            },  # fmt: skip
        }[fmt]
        for suffix, shapes in expected.items():
            scale = tensors.get(sibling(name, suffix))
            if scale is None:
                raise ValueError(f"{fmt} tensor {name} has no sibling {sibling(name, suffix)}")
            if tuple(scale.shape) not in shapes:
                raise ValueError(
                    f"{sibling(name, suffix)}: shape {tuple(scale.shape)} does not fit {fmt} weight {name} "
                    f"{(out, cols)} (expected {' or '.join(map(str, shapes))})"
                )
            wanted = (torch.float32,) if fmt in (INT8, INT4) else _SCALE_DTYPES
            if scale.dtype not in wanted:
                raise ValueError(f"{sibling(name, suffix)}: dtype {scale.dtype}, expected one of {wanted}")


def check_description(path: str | Path, stored: dict[str, StoredTensor]) -> None:
    """An msModelSlim checkpoint's ``quant_model_description.json`` agrees with its shards: every tensor it
    names exists, each ``W8A8_DYNAMIC`` weight is int8 with its scale and each ``W4A8_DYNAMIC`` one a
    routed expert's packed int4 with its scale and ``scale_bias``."""
    file = Path(path) / DESCRIPTION_FILE
    if not file.exists():
        return
    entries = {k: v for k, v in json.loads(file.read_text()).items() if k not in _SLIM_FIELDS}
    for name, kind in sorted(entries.items()):
        if kind not in SLIM_TYPES:
            raise ValueError(f"{DESCRIPTION_FILE}: {name} has type {kind!r}, not one of {SLIM_TYPES}")
        if name not in stored and not _TEXT_ONLY_SKIPS.search(name):
            raise ValueError(f"{DESCRIPTION_FILE} names tensor {name}, which no shard of the checkpoint has")
        if kind == "W4A8_DYNAMIC" and name.endswith(".weight"):
            if not _FP4.search(name):
                raise ValueError(f"{name}: W4A8_DYNAMIC (int4 weights) is supported for routed experts only")
            if stored_format(name, stored) != INT4:
                raise ValueError(
                    f"{name}: W4A8_DYNAMIC needs an int8 weight with {W8A8_SCALE} and {SCALE_BIAS} siblings"
                )
        if kind == "W8A8_DYNAMIC" and name.endswith(".weight") and stored_format(name, stored) != INT8:
            raise ValueError(f"{name}: W8A8_DYNAMIC needs an int8 weight with a {W8A8_SCALE} sibling")


def loader_quantization(path: str | Path, requested: str | None) -> str:
    """vLLM's ``quantization`` argument -> the loader's mode: None or the checkpoint's own format (``fp8``;
    ``ascend`` for msModelSlim) keeps it as stored; ``w8a8`` requantises an FP8 checkpoint to int8."""
    q = ModelConfig.from_file(path).quantization_config
    stored = "ascend" if (Path(path) / DESCRIPTION_FILE).exists() else (q or {}).get("quant_method")
    if requested not in (None, stored) and (requested, stored) != ("w8a8", "fp8"):
        raise ValueError(f"quantization={requested!r}: the checkpoint is stored as {stored or 'unquantized'}")
    return "w8a8" if requested == "w8a8" else "auto"


def build_model(cfg: ModelConfig, path: str | Path) -> CausalLM:
    """The model of ``cfg``, on ``meta``: V4.1 Engram needs the checkpoint's tokenizer."""
    token_map = None
    if cfg.is_v41 and cfg.engram:
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


def placement_arguments(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--dtype`` as ``placement`` reads them, for the scripts and benchmarks."""
    parser.add_argument("--device", choices=DEVICES, help="default: the accelerator present, else cpu")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_NAMES],
                        help="auto: bfloat16 on npu / cuda, float32 on cpu")  # fmt: skip


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    quantization: str = "auto",
    parallel: ParallelContext | None = None,
    engram_offload: bool = False,
) -> CausalLM:
    """The checkpoint's model on ``device``, computing in ``dtype`` (fp32 or bf16; the tensors of
    model-spec §9.1 stay fp32), its quantised weights kept as ``quantization`` says; with ``parallel``
    over several ranks, this rank's share only, read from the checkpoint as slices. ``engram_offload``
    keeps the V4.1 Engram tables in host memory (pinned on an accelerator): each lookup gathers its rows
    there and copies only those to ``device``."""
    model, stored, shard = plan_shard(path, dtype, quantization, parallel)
    model = model.to_empty(device=device)
    for module in model.modules():  # the projections of one input that run as one GEMM
        if hasattr(module, "stack_projections"):
            module.stack_projections()
    if engram_offload:
        for module in model.modules():
            if isinstance(module, Engram):
                module.keep_table_on_host(pin=torch.device(device).type != "cpu")
    with torch.no_grad():
        stream_weights(stored, model.official_state(), model.cfg.fp8_block, shard)
    model.init_buffers()
    return model.requires_grad_(False).eval()  # inference only


def plan_model(
    path: str | Path, dtype: torch.dtype = torch.float32, quantization: str = "auto"
) -> tuple[CausalLM, dict[str, StoredTensor]]:
    """The model on ``meta`` exactly as ``load_model`` will fill it (packed layers swapped in, parameter
    dtypes set) and the checkpoint's tensors, all from the headers: every check done, no byte read."""
    model, stored, _ = plan_shard(path, dtype, quantization)
    return model, stored


def plan_shard(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    quantization: str = "auto",
    parallel: ParallelContext | None = None,
) -> tuple[CausalLM, dict[str, StoredTensor], ShardPlan | None]:
    """``plan_model``, cut down to one rank's share when ``parallel`` spans several ranks (with the
    ``ShardPlan`` the loader follows; split FP8 weights keep their stored bytes and block scales)."""
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype={dtype}: the model computes in {' or '.join(map(str, COMPUTE_DTYPES))}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r}: one of {', '.join(QUANTIZATIONS)}")
    cfg = ModelConfig.from_file(path)
    stored = {n: t for n, t in stored_tensors(path).items() if not _TEXT_ONLY_SKIPS.search(n)}
    if cfg.num_draft_layers and not any(name.startswith(DRAFT_PREFIX) for name in stored):
        cfg = cfg.without_drafts()
    model = build_model(cfg, path)
    check_description(path, stored)  # first: it names a missing sibling that would mis-shape its weight
    check_names(
        model.checkpoint_names(), {name: unpacked_shape(name, stored) for name in weight_names(stored)}
    )
    check_scales(stored, cfg.fp8_block)
    shard = None
    if parallel is not None and parallel.world > 1:
        shard = shard_model(model, parallel)
    pack_linears(model, stored, cfg.fp8_block, quantization, shard)
    if shard is not None:
        connect(model, shard)
    for name, param in model.named_parameters():
        param.data = param.data.to(parameter_dtype(name, dtype))  # still on meta: no bytes yet
    return model, stored, shard


def pack_linears(
    model: nn.Module,
    stored: dict[str, StoredTensor],
    block: int | None,
    quantization: str,
    shard: ShardPlan | None = None,
) -> None:
    """Swap, on ``meta``, each linear the checkpoint stores quantised for the packed layer that keeps it
    so (``auto``) or for int8 W8A8 (``w8a8``), and stack each MoE layer's routed experts in that format (a
    ``shard``'s own experts only; its split FP8 weights read their slices of the block scales too); FP8
    Engram tables stay FP8 (only the rows a step reads are decoded)."""
    if quantization == "dense":
        return
    for prefix, module in list(model.named_modules()):
        if isinstance(module, StackedExperts):  # a MoE layer's routed experts, or one rank's share
            fmt, columns = expert_format(prefix, stored, block)
            if fmt != DENSE:
                replace_module(
                    model, prefix, module.pack(INT8 if quantization == "w8a8" else fmt, block or 1, columns)
                )
        if isinstance(module, Engram) and stored_format(f"{prefix}.embed.weight", stored) == FP8:
            module.pack_table(block)  # a lookup, not a GEMM: kept FP8 under w8a8 too
    for prefix, module in list(model.named_modules()):
        name = f"{prefix}.weight"
        if not isinstance(module, DenseLinear) or name not in stored:
            continue
        fmt, shape = stored_format(name, stored), (module.in_features, module.out_features)
        if fmt == DENSE:
            continue
        if quantization == "w8a8" or fmt == INT8:
            packed = Int8Linear(*shape)
            part = shard.slices.get(name) if shard is not None else None
            if part is not None and part.dim == 0:  # per-output-channel scales go with their rows
                for suffix in (W8A8_SCALE, W8A8_OFFSET):
                    shard.slices[sibling(name, suffix)] = part
        elif fmt == MXFP4:
            packed = Mxfp4Linear(*shape)
        elif _block_scaled(name, stored, block):
            packed = Fp8Linear(*shape, block)
            if shard is not None and name in shard.slices:
                shard.slices[sibling(name, SCALE)] = shard.slices[name].blocks(block, name)
        else:
            continue  # FP8 with per-row scales on a linear: dequantised at load
        replace_module(model, prefix, packed)


def _block_scaled(name: str, stored: dict[str, StoredTensor], block: int | None) -> bool:
    if block is None:
        return False
    out, cols = stored[name].shape
    return tuple(stored[sibling(name, SCALE)].shape) == (-(-out // block), -(-cols // block))


def expert_format(
    prefix: str, stored: dict[str, StoredTensor], block: int | None
) -> tuple[str, tuple[int, ...]]:
    """The one stored format of every routed expert under ``prefix`` (a ValueError names the first that
    differs) and W4A8's ``scale_bias`` columns per projection; FP8 without block scales counts as dense."""
    names = sorted(n for n in stored if n.startswith(f"{prefix}.") and n.endswith(".weight"))
    fmt = stored_format(names[0], stored)
    for name in names:
        if stored_format(name, stored) != fmt:
            raise ValueError(f"{name}: stored {stored_format(name, stored)}, but {names[0]} is {fmt}")
    if fmt == FP8 and not _block_scaled(names[0], stored, block):
        return DENSE, BIAS_COLUMNS
    if fmt != INT4:
        return fmt, BIAS_COLUMNS
    return fmt, tuple(stored[f"{prefix}.0.{p}{SCALE_BIAS}"].shape[-1] for p in StackedExperts.PROJECTIONS)


def stream_weights(
    stored: dict[str, StoredTensor],
    targets: dict[str, torch.Tensor],
    block: int | None,
    shard: ShardPlan | None = None,
) -> None:
    """Fill every target, shard by shard in byte order: bytes the model keeps as stored are read into
    their tensor directly; the others are read with their scales and converted one weight at a time.
    With a ``shard``, split tensors are read as this rank's slice and other ranks' tensors skipped."""
    slices, elsewhere = (shard.slices, shard.elsewhere) if shard else ({}, set())
    filled: set[str] = set()
    for name, entry in stored.items():
        target, part = targets.get(name), slices.get(name)
        if part is not None and entry.dtype == target.dtype:
            part.read_into(entry, target)
            filled.add(name)
        elif part is None and target is not None and _same_bytes(entry, target):
            entry.read_into(target)
            filled.add(name)
    for name in weight_names(stored):
        if name in filled or name in elsewhere:
            continue
        parts = {n: stored[n].read() for n in (name, *(sibling(name, s) for s in _SIBLINGS)) if n in stored}
        target = targets[name]
        if target.dtype == torch.int8:  # requantised to W8A8 (model-spec §9.4)
            # Per output row over the whole row, then cut: a column slice keeps its rows' whole scales.
            q, scale = quantize_int8_ref(unpack(name, parts, block, torch.float32))
            part = slices.get(name)
            target.copy_(q if part is None else part.take(q))
            rows = part is not None and part.dim == 0
            targets[sibling(name, W8A8_SCALE)].copy_(part.take(scale[:, None]) if rows else scale[:, None])
            targets[sibling(name, W8A8_OFFSET)].zero_()
            filled.update((sibling(name, W8A8_SCALE), sibling(name, W8A8_OFFSET)))
        else:
            value = unpack(name, parts, block, target.dtype)
            target.copy_(slices[name].take(value) if name in slices else value)
        filled.add(name)
    if unfilled := sorted(set(targets) - filled):
        raise ValueError(f"the checkpoint left model tensors unfilled: {', '.join(unfilled)}")
    for name in (n for n in targets if n.endswith(W8A8_OFFSET)):
        if targets[name].any():  # one read per W8A8 linear, at load only
            raise ValueError(f"{name}: nonzero offsets (asymmetric W8A8) are not supported, only symmetric")


def _same_bytes(entry: StoredTensor, target: torch.Tensor) -> bool:
    raw = {torch.int8, torch.uint8}
    same = entry.dtype == target.dtype or {entry.dtype, target.dtype} <= raw
    return same and target.numel() == math.prod(entry.shape)  # msModelSlim scales: [out] or [out, 1]


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
