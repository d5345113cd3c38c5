"""The kernels' shape limits and their checks, in plain Python: the model config holds a checkpoint to
them without loading Triton or any kernel (``model.config.validate``)."""

from __future__ import annotations

MAX_K = 2048  # top-k: picks per row
MAX_CANDIDATE_BLOCK = 256  # positions per candidate block: one block-maximum tile holds whole blocks
INDEXER_MAX_HEADS = 64  # the indexer's tuned tiles hold a whole query
INDEXER_MAX_DIM = 128


def check_k(name: str, k: int, limit: int) -> None:
    if not 0 <= k <= limit:
        raise ValueError(f"{name}: {k} must be in [0, {limit}]")


def check_candidate_geometry(block_size: int, topk_blocks: int) -> None:
    if block_size < 1 or block_size > MAX_CANDIDATE_BLOCK or block_size & (block_size - 1):
        raise ValueError(
            f"candidate block_size: {block_size} must be a power of two in [1, {MAX_CANDIDATE_BLOCK}]"
        )
    check_k("topk_blocks", topk_blocks, MAX_K)
