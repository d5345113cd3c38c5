"""The memory plan made at start-up, before any weight byte is read: weights (from the shard headers, as
the loader will hold them), an activation workspace for ``max_num_batched_tokens``, and the KV cache
from what remains of the budget (``--gpu-memory-utilization`` of the device, or ``--kv-cache-memory``
bytes outright). Over several ranks the weights are one rank's share (the sharded shapes: every rank
holds the same amount). A plan whose KV cache cannot hold one request of ``max_model_len`` is refused, naming
the numbers, so a server that would fail its first long request never starts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.kv_cache import KVCacheManager
from model.cache import CacheLayout
from model.causal_lm import CausalLM
from model.checkpoint import plan_shard
from model.config import ModelConfig
from model.engram import Engram
from model.parallel.context import ParallelContext

GIB = 2**30
_UNBOUNDED = 2**50  # tokens: a cap no cache reaches, for the capacity of the whole cache


def activation_bytes(cfg: ModelConfig, tokens: int, dtype_bytes: int) -> int:
    """Live activations of one step of ``tokens`` tokens, one layer at a time: the mHC streams and their
    mixed copy (fp32), the query heads, the MoE's per-choice hidden and output rows (fp32, sorted by
    expert) and fp32 logits for every token (the upper bound: a prefill step samples only its last)."""
    streams = 3 * cfg.hc_mult * cfg.hidden_size * 4
    queries = 2 * cfg.num_attention_heads * cfg.head_dim * dtype_bytes
    experts = cfg.num_experts_per_tok * (cfg.moe_intermediate_size + cfg.hidden_size) * 4
    return tokens * (streams + queries + experts + cfg.vocab_size * 4)


@dataclass(frozen=True)
class MemoryPlan:
    weight_bytes: int
    activation_bytes: int
    kv_bytes: int
    block_bytes: int
    blocks_per_request: int
    max_model_len: int
    budget: str  # how kv_bytes was chosen, for the messages
    kv_cache_dtype: str = "auto"
    capacity_tokens: int = 0  # the longest request the whole cache holds
    host_bytes: int = 0  # weights kept in host memory (the offloaded Engram tables), not in weight_bytes

    @property
    def num_blocks(self) -> int:
        return self.kv_bytes // self.block_bytes

    @property
    def max_concurrency(self) -> float:
        return self.num_blocks / self.blocks_per_request

    def line(self) -> str:
        host = f" (Engram tables in host memory: {self.host_bytes / GIB:.3f} GiB)" if self.host_bytes else ""
        return (
            f"Memory plan: weights {self.weight_bytes / GIB:.3f} GiB{host}, activations "
            f"{self.activation_bytes / GIB:.3f} GiB, KV cache {self.kv_bytes / GIB:.3f} GiB "
            f"({self.budget}) = {self.num_blocks} blocks x {self.block_bytes} B, {self.kv_cache_dtype} rows "
            f"holding {self.capacity_tokens} tokens; maximum concurrency at {self.max_model_len} tokens per "
            f"request: {self.max_concurrency:.2f}x"
        )


def plan_memory(
    path: str | Path,
    dtype: torch.dtype,
    quantization: str,
    *,
    max_num_batched_tokens: int,
    max_model_len: int | None,
    block_size: int,
    kv_cache_memory: int | None = None,
    gpu_memory_utilization: float | None = None,
    device_bytes: int | None = None,
    lookahead: int = 0,
    parallel: ParallelContext | None = None,
    graph_tokens: int = 0,
    kv_cache_dtype: str = "auto",
    engram_offload: bool = False,
) -> MemoryPlan:
    """The plan for serving ``path`` on one device (``parallel``: that of the rank it names, every rank's
    KV cache sized alike); ``gpu_memory_utilization`` shares ``device_bytes`` between weights,
    activations and the KV cache, else the KV cache gets ``kv_cache_memory`` bytes, if the device has
    them beside the weights and activations (``device_bytes``, when given). ``max_model_len`` None (vLLM's
    ``auto``): the longest request that KV cache holds, at most the model's ``max_position_embeddings``.
    ``kv_cache_dtype`` sizes the blocks as the cache stores its rows (``model.cache.row_formats``);
    ``engram_offload`` keeps the Engram tables in host memory, out of the device's weights.
    ``graph_tokens``: the largest captured decode step's tokens; the graphs' memory pool holds that step's
    activations beside the eager workspace."""
    model, _, _ = plan_shard(path, dtype, quantization, parallel)
    host = engram_table_bytes(model) if engram_offload else 0
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values()) - host
    itemsize = torch.empty(0, dtype=dtype).element_size()
    activations = activation_bytes(model.cfg, max_num_batched_tokens, itemsize)
    activations += activation_bytes(model.cfg, graph_tokens, itemsize)
    if gpu_memory_utilization is not None:
        if device_bytes is None:
            raise ValueError("gpu_memory_utilization needs the device's memory size")
        budget = int(gpu_memory_utilization * device_bytes)
        kv = budget - weights - activations
        how = f"{gpu_memory_utilization} x {device_bytes / GIB:.1f} GiB less weights and activations"
    else:
        if kv_cache_memory is None:
            raise ValueError("give kv_cache_memory or gpu_memory_utilization")
        kv, how = kv_cache_memory, "--kv-cache-memory"
        if device_bytes is not None and weights + activations + kv > device_bytes:
            raise ValueError(
                f"memory plan: --kv-cache-memory={kv} B with weights {weights / GIB:.3f} GiB and activations "
                f"{activations / GIB:.3f} GiB exceeds the device's {device_bytes / GIB:.1f} GiB"
            )
    chunk = max_num_batched_tokens + lookahead
    cache, capacity = cache_capacity(model.cfg, dtype, kv_cache_dtype, kv, block_size, chunk, lookahead)
    if max_model_len is None:
        max_model_len = min(capacity, model.cfg.max_position_embeddings)
    per_request = cache.max_blocks(max_model_len + lookahead, chunk)
    plan = MemoryPlan(weights, activations, max(kv, 0), cache.block_bytes, per_request, max_model_len, how,
                      kv_cache_dtype, capacity, host)  # fmt: skip
    if plan.num_blocks < per_request:
        raise ValueError(
            f"memory plan: the KV cache gets {kv / GIB:.3f} GiB ({how}; weights {weights / GIB:.3f} GiB, "
            f"activations at {max_num_batched_tokens} batched tokens {activations / GIB:.3f} GiB), but one "
            f"request of max_model_len={max_model_len} needs {per_request} blocks x {cache.block_bytes} B = "
            f"{per_request * cache.block_bytes / GIB:.3f} GiB: give more memory or lower max_model_len"
        )
    return plan


def engram_table_bytes(model: CausalLM) -> int:
    """Bytes of the Engram bucket tables (as loaded: FP8 bytes and their scales, or the compute dtype)."""
    tables = (m.embed for m in model.modules() if isinstance(m, Engram))
    return sum(t.numel() * t.element_size() for table in tables for t in table.state_dict().values())


def cache_capacity(
    cfg: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str, kv_bytes: int, block_size: int, chunk: int,
    lookahead: int = 0,
) -> tuple[KVCacheManager, int]:  # fmt: skip
    """The block accounting of a cache whose rows are stored as ``kv_cache_dtype``, and the tokens of the
    longest request ``kv_bytes`` of its blocks hold (prefilled in chunks of ``chunk``)."""
    cache = KVCacheManager(CacheLayout.for_model(cfg, dtype, block_size, kv_cache_dtype), 1)
    fits = max(kv_bytes, 0) // cache.block_bytes
    return cache, longest_request(cache, fits, _UNBOUNDED, chunk, lookahead)


def longest_request(cache: KVCacheManager, num_blocks: int, cap: int, chunk: int, lookahead: int) -> int:
    """The most tokens, up to ``cap``, one request may hold in ``num_blocks`` blocks (1 when none fit, so
    that the plan's refusal names the shortfall); a request's blocks grow with its length."""
    low, high = 1, cap
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if cache.max_blocks(mid + lookahead, chunk) <= num_blocks else (low, mid - 1)
    return low
