"""The FastAPI app: the routes, the error handlers and the HTTP metrics middleware around an OpenAIServer.

Every defect of a request is an OpenAI-style 4xx (400; 401 for a bad API key, 404 for an unknown model, 413
for a body over the limit, 415 for one that is not JSON); a full queue or a shutdown answers 503.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import version as package_version

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.server.api import OpenAIServer
from engine.server.chat import chat_completions
from engine.server.completions import completions
from engine.server.metrics import Metrics
from engine.server.protocol import APIError
from engine.server.responses import responses

log = logging.getLogger(__name__)

ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/health",
             "/metrics", "/ping", "/version", "/v1/responses")  # fmt: skip


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


async def log_stats(server: OpenAIServer, every: float = 10.0) -> None:
    """vLLM's periodic line: throughput, requests and KV cache usage, while there is anything to say."""
    metrics, last = server.metrics, (0.0, 0.0)
    while True:
        await asyncio.sleep(every)
        tokens = (metrics.count(metrics.prompt_tokens), metrics.count(metrics.generation_tokens))
        running, waiting = metrics.count(metrics.running), metrics.count(metrics.waiting)
        if tokens == last and not running and not waiting:
            continue
        prompt, generated = ((now - before) / every for now, before in zip(tokens, last, strict=True))
        last = tokens
        log.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            prompt, generated, running, waiting, 100 * server.engine.stats().kv_usage,
            100 * metrics.prefix_hit_rate(),
        )  # fmt: skip


def build_app(
    server: OpenAIServer, announce: str | None = None, log_stats_every: float | None = 10.0
) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.core.start()
        stats = asyncio.ensure_future(log_stats(server, log_stats_every)) if log_stats_every else None
        if announce:
            print(announce, flush=True)
        yield
        if stats is not None:
            stats.cancel()
        server.core.stop()

    app = FastAPI(title="deepseek-ascend", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_api_route("/v1/models", server.models, methods=["GET", "HEAD"])  # HEAD: a client's probe
    app.add_api_route("/v1/models/{model_id:path}", server.model, methods=["GET"])
    app.add_api_route("/tokenize", server.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", server.detokenize, methods=["POST"])

    @app.post("/v1/completions")
    async def complete(request: Request) -> Response:
        return await completions(server, request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await chat_completions(server, request)

    @app.post("/v1/responses")
    async def respond(request: Request) -> Response:
        return await responses(server, request)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        return Response(status_code=200 if server.core.alive and server.core.accepting else 503)

    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's (and SageMaker's) liveness route
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": package_version("deepseek-ascend")})

    @app.api_route("/metrics", methods=["GET", "HEAD"])
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
