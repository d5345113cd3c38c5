"""OpenAI-compatible server: ``python -m engine.serve [--model DIR]``; no ``--model``: the tiny V4.1.

Routes: /v1/models, /v1/completions, /v1/chat/completions (streaming or not), /tokenize, /detokenize,
/health and /metrics (docs/serving.md); the app is engine/server/app.py, this is its command line.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path

import torch
import uvicorn

from engine.llm_engine import EngineConfig, LLMEngine
from engine.server.api import MAX_REQUEST_BYTES, OpenAIServer
from engine.server.app import build_app
from engine.server.shutdown import FLUSH_TIMEOUT, GracefulServer
from engine.spec_decode import SPECULATIVE_METHODS
from model.chat_profile import PROFILES, select_chat_profile
from model.checkpoint import load_model
from model.tiny import cached_tiny
from model.tokenizer import load_tokenizer
from triton_kernels import runtime

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)", re.I)


def parse_size(text: str) -> int:
    """Bytes from `268435456`, `256MiB`, `1.5GiB` or `512M` (powers of 1024)."""
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 256MiB")
    return int(float(m[1]) * 1024 ** " KMGT".index(m[2].upper() or " "))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.serve", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a DeepSeek V4/V4.1 checkpoint folder (default: the tiny V4.1)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="default: 8000")
    parser.add_argument("--served-model-name", nargs="+", help="names clients use (default: the folder name)")
    parser.add_argument("--api-key", help="require `Authorization: Bearer KEY` (all but /health, /metrics)")
    parser.add_argument(
        "--max-model-len", type=int, default=EngineConfig.max_model_len, help="prompt + completion limit"
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=EngineConfig.max_num_seqs, help="sequences running at once"
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens,
                        help="tokens per engine step")  # fmt: skip
    parser.add_argument("--kv-cache-memory", type=parse_size, default=EngineConfig.kv_cache_memory,
                        help="bytes for the KV cache blocks, e.g. 256MiB (default) or 8GiB")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seeds the requests that bring no seed")
    parser.add_argument("--speculative-method", choices=SPECULATIVE_METHODS,
                        help="draft with the MTP layer (V4) or the DSpark stages (V4.1)")  # fmt: skip
    parser.add_argument("--num-speculative-tokens", type=int,
                        help="drafts per step (default: 1 for mtp, the block for dspark)")  # fmt: skip
    parser.add_argument("--dspark-min-confidence", type=float, default=0.0,
                        help="verify the longest DSpark draft prefix whose confidence product stays at or "
                        "above this (default 0: every draft)")  # fmt: skip
    parser.add_argument("--max-request-bytes", type=parse_size, default=MAX_REQUEST_BYTES,
                        help="larger request bodies are refused with 413 (default: 4MiB)")  # fmt: skip
    parser.add_argument("--max-waiting-requests", type=int, default=256,
                        help="sequences waiting beyond --max-num-seqs; more: 503 (default 256)")  # fmt: skip
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds SIGTERM lets the requests in flight finish (default: 30)")  # fmt: skip
    parser.add_argument("--chat-encoding", choices=PROFILES,
                        help="override the checkpoint's chat encoding (docs/serving.md)")  # fmt: skip
    parser.add_argument("--torch-threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    # The engine thread's Python work (scheduling, sampling) holds the GIL between torch calls; handing
    # it over every 1 ms instead of 5 keeps the event loop, and so /health and the streams, responsive.
    sys.setswitchinterval(0.001)
    path = Path(args.model) if args.model else cached_tiny("v41")
    try:
        config = EngineConfig(args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len,
                              kv_cache_memory=args.kv_cache_memory, seed=args.seed,
                              speculative_method=args.speculative_method,
                              num_speculative_tokens=args.num_speculative_tokens,
                              dspark_min_confidence=args.dspark_min_confidence)  # fmt: skip
        engine = LLMEngine(load_model(path), load_tokenizer(path), config)
        chat = select_chat_profile(engine.model.cfg.model_type, path, args.chat_encoding)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    names = args.served_model_name or ["deepseek-v4.1-tiny" if args.model is None else path.resolve().name]
    url = f"http://{args.host}:{args.port}"
    announce = f"Serving {names[0]} from {path} at {url}/v1  (try: curl {url}/v1/models)"
    announce += f"\nChat encoding: {chat.name}" + (" (--chat-encoding)" if args.chat_encoding else "")
    tuned = engine.tuned_files
    announce += f"\nKernel configs for {runtime.sku()}: " + (
        f"{len(tuned)} tuned files in {tuned[0].parent}" if tuned else "heuristic defaults (no tuned files)"
    )
    logging.basicConfig(level=args.log_level.upper())
    try:
        server = OpenAIServer(
            engine, names, args.api_key, str(path), chat, args.max_request_bytes, args.max_waiting_requests
        )
    except ValueError as err:
        parser.error(str(err))
    app = build_app(server, announce)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=FLUSH_TIMEOUT)  # fmt: skip
    GracefulServer(config, server.core, args.shutdown_timeout).run()
    # Every stream is closed and the engine stopped: skip the interpreter's teardown of torch and the
    # model, which takes seconds the shutdown timeout has no room for.
    logging.shutdown()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
