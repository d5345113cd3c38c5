"""Row gathers whose every lane addresses its tensor, as Triton-Ascend 3.2.0 needs.

Its adapter turns a masked access whose mask it cannot prove rectangular (a gather through clamped or
``-1`` row ids is one) into an unmasked access plus a select: masked-out lanes are really read, and an
address outside the tensor faults the device. Kernels therefore clamp indices before forming an address
and keep the mask for the values; a line doing so ends with ``# in-bounds: <why>`` (see
docs/ascend-gate.md, which also says how the gate and the interpreter tests check it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def take_rows(table: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """``table[at]`` for row ids ``at`` of any shape, as the references gather: one ``index_select``,
    which on the CPU takes a fraction of the time of advanced indexing."""
    return table.index_select(0, at.flatten()).view(*at.shape, *table.shape[1:])


@triton.jit
def gather_rows(base, rows, valid, cols, width, stride, inside):
    """The ``[rows, cols]`` tile of a ``[*, width]`` tensor of row stride ``stride`` (a column range of a
    wider buffer, as a KV pool is, needs no copy), 0 where not ``valid`` or past width.

    ``rows`` must be row ids of the tensor for every lane (clamp them first). ``inside`` says every column
    is below ``width``: the columns then stay contiguous (one transfer per row); otherwise those past the
    end read column ``width - 1``.
    """
    ptrs = base + rows[:, None] * stride
    mask = valid[:, None] & (cols < width)[None, :]
    if inside:
        tile = tl.load(ptrs + cols[None, :], mask=mask, other=0)  # in-bounds: rows clamped by the caller
    else:
        last = tl.minimum(cols, width - 1)
        tile = tl.load(ptrs + last[None, :], mask=mask, other=0)  # in-bounds: rows and columns clamped
    return tile
