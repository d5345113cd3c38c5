"""Starting the server once its port is bound: the model, the engine and the memory plan, the chat
encoding and the sampling defaults, the start-up lines, then uvicorn until a signal ends it."""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from importlib.metadata import version
from pathlib import Path

import torch
import uvicorn

from engine.llm_engine import EngineConfig, LLMEngine
from engine.server.api import MAX_REQUEST_BYTES, OpenAIServer
from engine.server.app import build_app
from engine.server.args import non_default
from engine.server.protocol import GENERATION_FIELDS
from engine.server.shutdown import FLUSH_TIMEOUT, GracefulServer
from model.chat_profile import select_chat_profile
from model.checkpoint import load_model, placement
from model.config import ModelConfig
from model.tiny import cached_tiny
from model.tokenizer import load_tokenizer
from triton_kernels import runtime

log = logging.getLogger(__name__)


def kv_cache_bytes(args: argparse.Namespace, weight_bytes: int) -> int:
    """--kv-cache-memory, or --gpu-memory-utilization of the device's memory less the weights."""
    if args.gpu_memory_utilization is None:
        return args.kv_cache_memory or EngineConfig.kv_cache_memory
    total = runtime.memory_bytes()
    budget = int(args.gpu_memory_utilization * total) - weight_bytes
    if budget <= 0:
        raise ValueError(
            f"--gpu-memory-utilization={args.gpu_memory_utilization} of {total / 2**30:.1f} GiB leaves "
            f"nothing for the KV cache after {weight_bytes / 2**30:.2f} GiB of weights"
        )
    return budget


def generation_defaults(args: argparse.Namespace, path: Path) -> dict[str, float]:
    """vLLM's --generation-config: the sampling defaults of generation_config.json, for the fields a
    request leaves unset."""
    if args.generation_config == "vllm":
        return {}
    folder = path if args.generation_config == "auto" else Path(args.generation_config)
    file = folder / "generation_config.json"
    if not file.exists():
        if args.generation_config != "auto":
            raise ValueError(f"--generation-config {folder}: no generation_config.json there")
        return {}
    raw = json.loads(file.read_text())
    return {k: raw[k] for k in GENERATION_FIELDS if isinstance(raw.get(k), int | float)}


def start_engine(args: argparse.Namespace, path: Path) -> LLMEngine:
    cfg = ModelConfig.from_file(path)
    if args.max_model_len > cfg.max_position_embeddings:
        raise ValueError(
            f"--max-model-len={args.max_model_len} exceeds the model's max_position_embeddings="
            f"{cfg.max_position_embeddings}"
        )
    stored = (cfg.quantization_config or {}).get("quant_method")
    if args.quantization is not None and args.quantization != stored:
        raise ValueError(
            f"--quantization={args.quantization}: the checkpoint is stored as {stored or 'unquantized'}"
        )
    device, dtype = placement(args.device, args.dtype)
    model = load_model(path, dtype, device)
    weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    config = EngineConfig(args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len, args.block_size,
                          kv_cache_bytes(args, weight_bytes), args.seed, args.speculative_method,
                          args.num_speculative_tokens, args.dspark_min_confidence,
                          args.enable_prefix_caching is not False, args.prefix_page_size)  # fmt: skip
    engine = LLMEngine(model, load_tokenizer(path), config)
    per_request = engine.cache.max_blocks(
        args.max_model_len + engine.lookahead, args.max_num_batched_tokens + engine.lookahead
    )
    if per_request > engine.cache.num_blocks:
        raise ValueError(
            f"the KV cache holds {engine.cache.num_blocks} blocks ({config.kv_cache_memory} bytes); one "
            f"request of --max-model-len={args.max_model_len} needs {per_request}: raise --kv-cache-memory "
            "or lower --max-model-len"
        )
    engine.weight_bytes = weight_bytes
    return engine


def plan_line(engine: LLMEngine) -> str:
    cache, cfg = engine.cache, engine.config
    per_request = cache.max_blocks(
        cfg.max_model_len + engine.lookahead, cfg.max_num_batched_tokens + engine.lookahead
    )
    return (
        f"Memory: weights {engine.weight_bytes / 2**20:.1f} MiB, KV cache {cache.num_blocks} blocks x "
        f"{cache.block_bytes} B = {cache.num_blocks * cache.block_bytes / 2**20:.1f} MiB; maximum "
        f"concurrency at {cfg.max_model_len} tokens per request: {cache.num_blocks / per_request:.2f}x"
    )


def serve(args: argparse.Namespace, sock: socket.socket) -> None:
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    # The engine thread's Python work (scheduling, sampling) holds the GIL between torch calls; handing
    # it over every 1 ms instead of 5 keeps the event loop, and so /health and the streams, responsive.
    sys.setswitchinterval(0.001)
    path = Path(args.model) if args.model else cached_tiny("v41")
    try:
        engine = start_engine(args, path)
        chat = select_chat_profile(engine.model.cfg.model_type, path, args.chat_encoding)
        names = args.served_model_name or [
            "deepseek-v4.1-tiny" if args.model is None else path.resolve().name
        ]
        server = OpenAIServer(engine, names, args.api_keys, str(path), chat,
                              args.max_request_bytes or MAX_REQUEST_BYTES,
                              args.max_waiting_requests, generation_defaults(args, path),
                              args.enable_log_requests)  # fmt: skip
    except (ValueError, FileNotFoundError) as err:
        sock.close()
        raise SystemExit(f"error: {err}") from None
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    url = f"http://{host}:{args.port}"
    tuned = engine.tuned_files
    kernels = f"{len(tuned)} tuned files in {tuned[0].parent}" if tuned else "heuristic defaults (none tuned)"
    announce = "\n".join([
        f"deepseek-ascend {version('deepseek-ascend')}; non-default flags: {non_default(args) or 'none'}",
        f"Model on {engine.runner.device} in {engine.model.embed.weight.dtype}",
        plan_line(engine),
        f"Chat encoding: {chat.name}" + (" (--chat-encoding)" if args.chat_encoding else ""),
        f"Kernel configs for {runtime.sku()}: {kernels}",
        f"Serving {names[0]} from {path} at {url}/v1  (try: curl {url}/v1/models)",
    ])  # fmt: skip
    app = build_app(server, announce, None if args.disable_log_stats else 10.0)
    config = uvicorn.Config(app, log_level=args.uvicorn_log_level, timeout_graceful_shutdown=FLUSH_TIMEOUT)
    GracefulServer(config, server.core, args.shutdown_timeout).run(sockets=[sock])
    # Every stream is closed and the engine stopped: skip the interpreter's teardown of torch and the
    # model, which takes seconds the shutdown timeout has no room for.
    logging.shutdown()
    sys.stdout.flush()
    os._exit(0)
