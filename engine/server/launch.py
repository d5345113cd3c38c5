"""Starting the server once its port is bound: the model, the engine and the memory plan, the chat
encoding and the sampling defaults, the start-up lines, then uvicorn until a signal ends it."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
from importlib.metadata import version
from pathlib import Path

import torch
import uvicorn

from engine.config import EngineConfig
from engine.factory import Started, default_model, start_engine
from engine.parallel.group import Rendezvous
from engine.parallel.processes import serve_node
from engine.server.api import MAX_REQUEST_BYTES, OpenAIServer
from engine.server.app import build_app
from engine.server.args import engine_config, non_default
from engine.server.protocol import GENERATION_FIELDS
from engine.server.shutdown import FLUSH_TIMEOUT, GracefulServer
from model.chat_profile import select_chat_profile
from model.checkpoint import placement
from model.config import ModelConfig
from triton_kernels import runtime

log = logging.getLogger(__name__)


def memory_budget(args: argparse.Namespace, config: EngineConfig) -> dict:
    """What ``plan_memory`` reads: the engine's limits and the share or bytes the flags give."""
    share = args.gpu_memory_utilization
    return {
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "max_model_len": None if args.max_model_len is None else config.max_model_len,  # None: auto
        "block_size": config.block_size,
        "kv_cache_memory": None if share else config.kv_cache_memory,
        "gpu_memory_utilization": share,
        "device_bytes": runtime.memory_bytes(),
        "lookahead": config.lookahead,
        "kv_cache_dtype": config.kv_cache_dtype,
        "engram_offload": config.engram_offload,
        "graph_tokens": 0
        if config.enforce_eager or runtime.backend() == "cpu" and not config.cpu_graphs
        else config.max_num_seqs * config.decode_width,
    }


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


def start(args: argparse.Namespace, path: Path) -> Started:
    cfg = ModelConfig.from_file(path)
    if args.max_model_len is not None and args.max_model_len > cfg.max_position_embeddings:
        raise ValueError(
            f"--max-model-len={args.max_model_len} exceeds the model's max_position_embeddings="
            f"{cfg.max_position_embeddings}"
        )
    config = engine_config(args)
    return start_engine(path, config, args.device, args.dtype, args.quantization, rendezvous(args),
                        memory_budget(args, config))  # fmt: skip


def rendezvous(args: argparse.Namespace) -> Rendezvous:
    return Rendezvous(args.master_addr, args.master_port, args.nnodes, args.node_rank, args.launcher_store)


def serve(args: argparse.Namespace, sock: socket.socket) -> None:
    if args.node_rank:  # a machine after the first: only its tensor-parallel ranks, no HTTP
        sock.close()
        try:
            device, _ = placement(args.device, args.dtype)
            raise SystemExit(serve_node(engine_config(args).world_size, rendezvous(args), device.type))
        except ValueError as err:
            raise SystemExit(f"error: {err}") from None
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    # The engine thread's Python work (scheduling, sampling) holds the GIL between torch calls; handing
    # it over every 1 ms instead of 5 keeps the event loop, and so /health and the streams, responsive.
    sys.setswitchinterval(0.001)
    path = Path(args.model) if args.model else default_model()
    try:
        # Said plainly, not as a file's JSON error: vLLM's hub names (org/model) are not downloaded here.
        if not path.is_dir():
            raise ValueError(f"--model {path}: no such checkpoint folder")
        started = start(args, path)
        engine, plan, workers = started.engine, started.memory, started.workers
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
        f"Model on {engine.model.embed.weight.device} in {engine.model.embed.weight.dtype}",
        plan.line(),
        f"Chat encoding: {chat.name}" + (" (--chat-encoding)" if args.chat_encoding else ""),
        f"Kernel configs for {runtime.sku()}: {kernels}",
        f"Serving {names[0]} from {path} at {url}/v1  (try: curl {url}/v1/models)",
    ])  # fmt: skip
    app = build_app(server, announce, None if args.disable_log_stats else 10.0)
    config = uvicorn.Config(app, log_level=args.uvicorn_log_level, timeout_graceful_shutdown=FLUSH_TIMEOUT,
                            access_log=not args.disable_uvicorn_access_log)  # fmt: skip
    if workers is not None:
        workers.watch(lambda err: _stop_on_failure(server, err))
    GracefulServer(config, server.core, args.shutdown_timeout).run(sockets=[sock])
    if workers is not None:
        workers.close()
    # Every stream is closed and the engine stopped: skip the interpreter's teardown of torch and the
    # model, which takes seconds the shutdown timeout has no room for.
    logging.shutdown()
    sys.stdout.flush()
    os._exit(1 if workers is not None and workers.failed else 0)


def _stop_on_failure(server: OpenAIServer, err: Exception) -> None:
    """A tensor-parallel worker is gone: /health answers 503 and the server shuts down as on SIGTERM."""
    log.error("%s: the server stops", err)
    server.core.accepting = False
    os.kill(os.getpid(), signal.SIGTERM)
