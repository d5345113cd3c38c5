"""Safetensors shards read through their headers: every name, dtype, shape and byte range is known (and
checked against the file) before any tensor byte is read; then tensors are read one at a time, into
their destination directly when it is host memory."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "BOOL": torch.bool,
}
_HEADER_LIMIT = 100 << 20  # a header larger than this is a corrupt length, not a real checkpoint


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a shard: where its bytes are and what they hold."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    nbytes: int

    def read(self) -> torch.Tensor:
        """The tensor in host memory (its own buffer)."""
        out = torch.empty(self.shape, dtype=self.dtype)
        self.read_into(out)
        return out

    def read_into(self, target: torch.Tensor) -> None:
        """Copy the stored bytes into ``target`` (as many elements of the same size); host targets are
        read into directly, device targets through one host buffer of this tensor's size."""
        if target.numel() != math.prod(self.shape) or target.element_size() != self.dtype.itemsize:
            raise ValueError(
                f"{self.name}: stored {self.dtype} {self.shape} cannot fill "
                f"{target.dtype} {tuple(target.shape)}"
            )
        if self.nbytes == 0:
            return
        host = target if target.device.type == "cpu" and target.is_contiguous() else None
        buffer = (
            host.view(-1).view(torch.uint8)
            if host is not None
            else torch.empty(self.nbytes, dtype=torch.uint8)
        )
        with open(self.file, "rb") as f:
            f.seek(self.start)
            if f.readinto(buffer.numpy()) != self.nbytes:
                raise ValueError(
                    f"{self.name}: {self.file.name} ends before the tensor's {self.nbytes} bytes"
                )
        if host is None:
            target.view(-1).view(torch.uint8).copy_(buffer)


def read_header(file: Path) -> dict[str, StoredTensor]:
    """The tensors of one shard, each checked: a known dtype, bytes that match its shape, all inside
    the file (a truncated shard is refused naming the first tensor it cuts)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        prefix = f.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else None
        if length is None or length > min(size - 8, _HEADER_LIMIT):
            raise ValueError(
                f"{file.name}: not a safetensors file, or truncated in its header ({size} bytes)"
            )
        header = json.loads(f.read(length))
    base, tensors = 8 + length, {}
    for name, info in sorted(header.items(), key=lambda item: item[1].get("data_offsets", [0])[0]):
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{name}: dtype {info['dtype']} is not one of {', '.join(_DTYPES)}")
        dtype, shape = _DTYPES[info["dtype"]], tuple(info["shape"])
        begin, end = info["data_offsets"]
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(
                f"{name}: {end - begin} bytes in {file.name} cannot hold {info['dtype']} {shape}"
            )
        if base + end > size:
            raise ValueError(
                f"{file.name} is truncated: tensor {name} needs bytes up to {base + end}, the file has {size}"
            )
        tensors[name] = StoredTensor(name, file, dtype, shape, base + begin, end - begin)
    return tensors


def read_headers(files: list[Path], weight_map: dict[str, str] | None = None) -> dict[str, StoredTensor]:
    """Every tensor of a checkpoint's shards, in shard then byte order; ``weight_map`` (the index) must
    agree with what the shards hold."""
    tensors: dict[str, StoredTensor] = {}
    for file in files:
        for name, stored in read_header(file).items():
            if name in tensors:
                raise ValueError(f"tensor {name} appears in more than one shard")
            tensors[name] = stored
    if weight_map is not None:
        for name, file in sorted(weight_map.items()):
            if name not in tensors or tensors[name].file.name != file:
                raise ValueError(f"the index puts tensor {name} in {file}, which does not hold it")
    return tensors


@dataclass(frozen=True)
class TensorSlice:
    dim: int
    start: int
    stop: int

    def take(self, t: torch.Tensor) -> torch.Tensor:
        return t.narrow(self.dim, self.start, self.stop - self.start)

    def blocks(self, block: int, name: str) -> TensorSlice:
        """The slice of a block-scale tensor that scales this slice of its weight: it must start and end on
        block boundaries (a block's one scale cannot be shared by two ranks)."""
        if self.start % block or self.stop % block:
            raise ValueError(
                f"{name}: the rank's slice [{self.start}, {self.stop}) of dimension {self.dim} does not fall "
                f"on the FP8 block of {block}"
            )
        return TensorSlice(self.dim, self.start // block, self.stop // block)

    def read_into(self, entry: StoredTensor, target: torch.Tensor) -> None:
        """Read this slice of a stored tensor into ``target`` of its dtype: a row slice is one contiguous
        byte range of the file; other slices read the tensor (host peak: one tensor) and cut it."""
        if self.dim != 0:
            target.copy_(self.take(entry.read()))
            return
        row_bytes = entry.nbytes // entry.shape[0]
        rows = StoredTensor(
            entry.name,
            entry.file,
            entry.dtype,
            (self.stop - self.start, *entry.shape[1:]),
            entry.start + self.start * row_bytes,
            (self.stop - self.start) * row_bytes,
        )
        rows.read_into(target)
