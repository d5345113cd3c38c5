"""OpenAI-compatible server: ``python -m engine.serve [--model DIR]``; no ``--model``: the tiny V4.1.

Routes: /v1/models, /v1/completions, /v1/chat/completions (streaming or not), /tokenize, /detokenize,
/health and /metrics (docs/serving.md). Every defect of a request is an OpenAI-style 4xx (400; 401 for a
bad API key, 404 for an unknown model, 413 for a body over the limit, 415 for one that is not JSON); a full
queue or a shutdown answers 503; a client that goes away aborts its request and frees its cache.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.llm_engine import EngineConfig, LLMEngine
from engine.metrics import Metrics
from engine.openai_chat import chat_completions
from engine.openai_protocol import APIError
from engine.openai_server import MAX_REQUEST_BYTES, OpenAIServer
from engine.shutdown import FLUSH_TIMEOUT, GracefulServer
from engine.spec_decode import SPECULATIVE_METHODS
from model.chat_profile import PROFILES, select_chat_profile
from model.checkpoint import load_model
from model.tiny import cached_tiny
from model.tokenizer import load_tokenizer
from triton_kernels import runtime

log = logging.getLogger(__name__)

ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/health",
             "/metrics")  # fmt: skip


class HTTPMetrics:
    """Counts responses by endpoint and status (a pure ASGI middleware: streaming and disconnects pass)."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
        started = disconnected = False

        async def receive_watched() -> Message:
            nonlocal disconnected
            message = await receive()
            disconnected = disconnected or message["type"] == "http.disconnect"
            return message

        async def send_status(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":  # now: a client may read a stream's end first
                started = True
                self.metrics.http.labels(endpoint, str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive_watched, send_status)
        finally:
            if not started:  # a client that went away is no server error
                self.metrics.http.labels(endpoint, "499" if disconnected else "500").inc()


def build_app(server: OpenAIServer, announce: str | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.core.start()
        if announce:
            print(announce, flush=True)
        yield
        server.core.stop()

    app = FastAPI(title="deepseek-ascend", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/tokenize", server.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", server.detokenize, methods=["POST"])

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await chat_completions(server, request)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if server.core.alive and server.core.accepting else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> Response:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> Response:
        return JSONResponse(APIError(str(err.detail), err.status_code).body(), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> Response:
        log.error("internal error on %s", request.url.path, exc_info=err)
        return JSONResponse(APIError("internal server error", 500).body(), status_code=500)

    @app.exception_handler(RecursionError)
    async def too_deep(request: Request, err: RecursionError) -> Response:
        return JSONResponse(APIError("the request is nested too deeply").body(), status_code=400)

    app.add_middleware(HTTPMetrics, metrics=server.metrics)
    return app


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
