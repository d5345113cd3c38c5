"""Building rank 0's engine: the one start sequence ``LLM`` and the server share (placement -> the
loader's quantization -> the memory plan, when asked -> the ranks -> the engine), and ``build_engine``,
the engine of each mode (one process, tensor parallel, data parallel)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from engine.config import EngineConfig
from engine.interface import Engine
from engine.kv_cache import KVCacheManager
from engine.llm_engine import LLMEngine
from engine.memory_plan import MemoryPlan, plan_memory
from engine.parallel.data_parallel import DataParallelEngine, lockstep_engine
from engine.parallel.group import Rendezvous
from engine.parallel.leader import LeaderRunner
from engine.parallel.processes import Workers, load_ranks
from engine.spec_decode.proposer import Proposer
from model.cache import check_kv_cache_device
from model.causal_lm import CausalLM
from model.checkpoint import loader_quantization, placement
from model.parallel.context import ParallelContext
from model.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class Started:
    """What the start sequence leaves running: the engine, the other ranks' workers (None: one process)
    and the memory plan it sized the KV cache with (None: ``EngineConfig.kv_cache_memory`` as given)."""

    engine: Engine
    workers: Workers | None
    memory: MemoryPlan | None


def default_model() -> Path:
    """The tiny V4.1 checkpoint ``LLM`` and the server run without a model; its writer (a test fixture)
    loads only when it is asked for."""
    from model.testing.tiny import cached_tiny

    return cached_tiny("v41")


def start_engine(
    path: str | Path,
    config: EngineConfig,
    device: str | None = None,
    dtype: str | torch.dtype = "auto",
    quantization: str | None = None,
    meet: Rendezvous = Rendezvous(),
    budget: dict[str, Any] | None = None,
) -> Started:
    """Place, load and start rank 0's engine over ``config.world_size`` ranks; ``budget``: what
    ``plan_memory`` reads to size the KV cache and settle ``max_model_len`` before any weight loads. The
    workers are closed again if anything fails on the way."""
    where, compute_dtype = placement(device, dtype)
    check_kv_cache_device(config.kv_cache_dtype, where)  # before any weight loads
    quantization = loader_quantization(path, quantization)
    memory = None
    if budget is not None:
        # The weights are one rank's share (rank 0's: every rank's is as large).
        rank0 = ParallelContext(0, config.world_size, data_parallel=config.data_parallel)
        memory = plan_memory(path, compute_dtype, quantization, parallel=rank0, **budget)
        log.info(memory.line())
        config = dataclasses.replace(
            config, kv_cache_memory=memory.kv_bytes, max_model_len=memory.max_model_len
        )
    model, workers = load_ranks(path, compute_dtype, where, config, quantization, meet)
    try:
        return Started(build_engine(model, load_tokenizer(path), config, workers), workers, memory)
    except BaseException:
        if workers is not None:
            workers.close()
        raise


def build_engine(
    model: CausalLM,
    tokenizer: Tokenizer,
    config: EngineConfig,
    workers: Workers | None,
    proposer: Proposer | None = None,
) -> Engine:
    """Rank 0's engine over ``workers``: the data-parallel front over its own engine, or one engine that
    runs every step with the tensor-parallel workers (none: a single process); ``proposer``: as
    ``LLMEngine``'s (tests and benchmarks)."""
    if config.data_parallel:
        assert workers is not None and proposer is None
        return DataParallelEngine(lockstep_engine(model, tokenizer, config), workers)
    runner = (
        None if workers is None else LeaderRunner(model, KVCacheManager.for_model(model, config), workers)
    )
    return LLMEngine(model, tokenizer, config, proposer, runner)
