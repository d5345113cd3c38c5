"""The OpenAI API over the async engine: reading and checking requests, submitting and driving their
sequences, the chat encoding, and the small routes (tokenize, detokenize, models).

The generation routes live beside it (completions.py, chat.py, responses.py), the app in app.py.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from engine.grammar import GrammarError, Grammars, LogitBias, ThinkingBudget, chain
from engine.interface import Engine
from engine.request import InvalidRequest, LogitsProcessor, SamplingParams
from engine.server.async_engine import AsyncEngine, Group, Unavailable, Update
from engine.server.metrics import Metrics
from engine.server.output import TokenTexts
from engine.server.protocol import (
    APIError,
    ChatCompletionRequest,
    DetokenizeRequest,
    Sampling,
    TokenizeRequest,
    validation_error,
)
from model.chat import ChatFormatError, check_tools, encode_messages, known_fields, loads_strict
from model.chat_profile import ChatProfile, EffortError, select_chat_profile
from model.tokenizer import THINK_END, TextTokenizer, prompt_ids

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
R = TypeVar("R")
Seq = tuple[list[int], SamplingParams, LogitsProcessor | None]  # prompt, params, processor of a sequence
MAX_REQUEST_BYTES = 4 * 2**20


def sse(obj: object) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def invalid_value_at(value: Any, where: str = "") -> APIError | None:
    """The error for the first value in parsed JSON that nothing downstream can take, located: a string
    that is not valid Unicode (a lone surrogate such as "\\ud800") or a number beyond float range."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            message = f"{where or 'body'}: the text is not valid Unicode (a lone surrogate)"
            return APIError(message, param=where)
    elif isinstance(value, float):
        if not math.isfinite(value):
            return APIError(f"{where}: the number is out of range", param=where)
    elif isinstance(value, dict):
        for key, item in value.items():
            # The path must survive the trip back in the error body: an invalid key is shown escaped.
            name = key.encode("utf-8", "backslashreplace").decode()
            inner = f"{where}.{name}" if where else name
            if (found := invalid_value_at(key, inner) or invalid_value_at(item, inner)) is not None:
                return found
    elif isinstance(value, list):
        for k, item in enumerate(value):
            if (found := invalid_value_at(item, f"{where}.{k}")) is not None:
                return found
    return None


class OpenAIServer:
    """The routes' logic. Parsing, validation, chat encoding and tokenisation run on a small worker pool,
    never on the event loop, so a large or slow request cannot stall other clients or /health."""

    def __init__(
        self,
        engine: Engine,
        names: list[str],
        api_keys: list[str] | None = None,
        root: str = "",
        chat: ChatProfile | None = None,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        max_waiting: int = 256,
        generation_defaults: dict[str, float] | None = None,
        log_requests: bool = False,
    ):
        self.engine, self.names, self.root = engine, names, root
        self.api_keys = [f"Bearer {key}".encode() for key in api_keys or []]
        self.max_request_bytes = max_request_bytes
        self.generation_defaults, self.log_requests = generation_defaults or {}, log_requests
        self.tokenizer = engine.tokenizer
        self.cfg = engine.model.cfg
        self.chat = chat or select_chat_profile(self.cfg.model_type, root or None)  # the chat encoding
        self.metrics = Metrics(names[0], engine.config.max_model_len, engine.stats().spec_decode is not None)
        self.core = AsyncEngine(engine, self.metrics, max_waiting)
        self.workers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="request")
        self.grammars = Grammars(self.tokenizer, self.cfg.vocab_size, self.cfg.eos_token_id)
        self.texts = TokenTexts(self.tokenizer)
        self.created = int(time.time())
        # A token covers at most this many bytes of text, so a text that long per token of the context is
        # refused before the BPE runs over it (minutes for megabytes). A normalizer could shrink the text.
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        self.max_token_bytes = (
            max(len(piece.encode()) for piece in vocab) if self.tokenizer.normalizer is None else None
        )

    # ---- request checks -------------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        if not self.api_keys:
            return
        given = request.headers.get("authorization", "").encode()
        matches = [hmac.compare_digest(given, key) for key in self.api_keys]  # every key: constant time
        if not any(matches):
            raise APIError("invalid or missing API key", 401, code="invalid_api_key")

    def check_accepting(self) -> None:
        if not self.core.accepting:
            raise APIError("the server is shutting down", 503, headers={"Retry-After": "5"})

    async def offload(self, fn: Callable[..., R], *args: Any) -> R:
        return await asyncio.get_running_loop().run_in_executor(self.workers, fn, *args)

    async def parse(self, request: Request, model: type[M]) -> M:
        self.authorize(request)
        self.check_accepting()
        return await self.offload(self.validate, await self.read_body(request), model)

    async def read_body(self, request: Request) -> bytes:
        """The body, refused with 413 as soon as it is longer than the limit (before it is all read)."""
        media = request.headers.get("content-type", "").split(";")[0].strip().lower() or "application/json"
        if media != "application/json" and not media.endswith("+json"):
            raise APIError(f"the body must be application/json, not {media!r}", 415)
        limit = self.max_request_bytes
        too_large = APIError(f"the request body is larger than the limit of {limit} bytes", 413)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise too_large
        except ClientDisconnect:
            raise APIError("the client disconnected while sending the body", 499) from None
        return bytes(body)

    def validate(self, raw: bytes, model: type[M]) -> M:
        try:
            data = loads_strict(raw.decode(), finite=False)
        except (ValueError, UnicodeDecodeError) as err:
            raise APIError(f"the request body is not valid JSON: {err}") from None
        if not isinstance(data, dict):
            raise APIError("the request body must be a JSON object")
        if (invalid := invalid_value_at(data)) is not None:
            raise invalid
        try:
            parsed = model.model_validate(data)
        except ValidationError as err:
            raise validation_error(err) from None
        if ignored := parsed.ignored_fields():
            log.warning("ignoring unknown request fields: %s", ", ".join(ignored))
        name = getattr(parsed, "model", None)
        if name:  # no name or an empty one: the served model, as vLLM
            self.check_model(name)
        return parsed

    def check_model(self, name: str) -> None:
        if name not in self.names:
            served = ", ".join(map(repr, self.names))
            message = f"the model {name!r} does not exist; this server serves {served}"
            raise APIError(message, 404, param="model", code="model_not_found")

    def text_prompt(self, text: str, add_bos: bool = True, param: str = "prompt") -> list[int]:
        """The prompt ids of `text` (model/tokenizer.prompt_ids); a text too long to fit the context
        whatever its tokens is refused before the tokenizer runs over it."""
        limit = self.engine.config.max_model_len
        if self.max_token_bytes is not None and len(text.encode()) > limit * self.max_token_bytes:
            raise APIError(f"the prompt has more than {limit} tokens, the context limit", param=param)
        return prompt_ids(self.tokenizer, text, self.cfg.bos_token_id, add_bos)

    def max_tokens(self, requested: int | None, prompt: list[int], param: str) -> int:
        room = self.engine.config.max_model_len - len(prompt)
        if room < 1:
            limit = self.engine.config.max_model_len
            raise APIError(f"the prompt has {len(prompt)} tokens; the context limit is {limit}", param=param)
        return requested if requested is not None else room

    async def processors(
        self,
        grammar: str | None,
        body: Sampling,
        param: str | None = None,
        budget: int | None = None,
    ) -> list[LogitsProcessor | None]:
        """One processor per choice: `logit_bias`, the thinking `budget`, then the grammar's matcher."""
        bias = body.token_bias(self.cfg.vocab_size)
        grammar_processors: list[Any] = [None] * body.n
        if grammar is not None:
            try:  # compiling a large schema takes a while: keep the event loop free
                grammar_processors = await self.offload(self.grammars.processors, grammar, body.n)
            except GrammarError as err:
                raise APIError(str(err), param=param) from None
        closer = None if budget is None else ThinkingBudget(budget, self.tokenizer.token_to_id(THINK_END))
        return [chain(LogitBias(bias) if bias else None, closer, g) for g in grammar_processors]

    async def submit(
        self, prefix: str, seqs: list[Seq], prompt_param: str, max_tokens_param: str = "max_tokens"
    ) -> Group:
        group_id = f"{prefix}-{uuid.uuid4().hex}"
        if self.log_requests:
            prompt, params, _ = seqs[0]
            log.info(
                "request %s: %d sequences, %d prompt tokens, %s", group_id, len(seqs), len(prompt), params
            )
        try:
            return await self.core.add(group_id, seqs)
        except Unavailable as err:
            headers = {"Retry-After": str(err.retry_after or 5)}
            raise APIError(str(err), 503, code="server_busy", headers=headers) from None
        except InvalidRequest as err:
            param = prompt_param if err.field == "prompt" else max_tokens_param
            raise APIError(str(err), param=param) from None
        except ValueError as err:
            raise APIError(str(err)) from None

    # ---- driving a group ------------------------------------------------------------------------------
    async def updates(self, group: Group) -> AsyncIterator[Update]:
        done = 0
        while done < len(group.ids):
            try:
                update = await asyncio.wait_for(group.updates.get(), timeout=5.0)
            except asyncio.TimeoutError:  # a long step, or an engine that ended without a word
                if not self.core.alive:
                    raise APIError("the engine is not running", 503) from None
                continue
            if update.finish_reason == "error":
                raise APIError(update.error or "engine error", update.status)
            done += update.finish_reason is not None
            yield update

    async def collect(self, request: Request, group: Group) -> list[Update]:
        """Every sequence's whole output (tokens and logprobs accumulated), or abort if the client leaves."""

        async def gather() -> list[Update]:
            finals = [Update(i, [], [], "") for i in range(len(group.ids))]
            async for u in self.updates(group):
                f = finals[u.index]
                f.token_ids += u.token_ids
                f.logprobs += u.logprobs
                f.text, f.finish_reason = u.text, u.finish_reason
                f.cached_tokens += u.cached_tokens
                f.prompt_logprobs = f.prompt_logprobs if u.prompt_logprobs is None else u.prompt_logprobs
            return finals

        async def disconnected() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(0.25)

        work, watch = asyncio.ensure_future(gather()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                raise APIError("client disconnected", 499)
            return work.result()
        finally:
            watch.cancel()
            work.cancel()
            self.core.abort(group)

    def stream(
        self,
        group: Group,
        chunks: AsyncIterator[str],
        error_event: Callable[[APIError], str] = lambda err: sse(err.body()),
        end: str = "data: [DONE]\n\n",
    ) -> StreamingResponse:
        """`chunks` as server-sent events; an error ends the stream with `error_event`, then `end`."""

        async def body() -> AsyncIterator[str]:
            try:
                async for chunk in chunks:
                    yield chunk
            except APIError as err:
                yield error_event(err)
            finally:  # also when the client disconnected and the response task was cancelled
                self.core.abort(group)
            yield end

        return StreamingResponse(body(), media_type="text/event-stream")

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        total = prompt_tokens + completion_tokens
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}  # fmt: skip

    # ---- chat encoding (engine/server/chat.py serves the route) ----------------------------------------
    def chat_prompt(self, body: ChatCompletionRequest | TokenizeRequest, mode: str, schema: Any) -> str:
        kwargs = body.chat_template_kwargs
        try:
            effort = self.chat.openai_effort(body.effort, body.thinking)
        except EffortError as err:
            raise APIError(str(err), param="reasoning_effort") from None
        try:
            if mode == "none" and body.tools is not None:
                check_tools(body.tools, self.chat)  # not shown to the model, yet checked
            messages, ignored = known_fields(body.messages or [])
            if ignored:
                log.warning("ignoring unknown message fields: %s", ", ".join(ignored))
            return encode_messages(
                messages,
                profile=self.chat,
                tools=body.tools if mode != "none" else None,
                thinking=body.thinking,
                reasoning_effort=effort,
                response_format=schema,  # shown to the model in the system section
                add_generation_prompt=body.add_generation_prompt,
                drop_thinking=kwargs.drop_thinking if kwargs else True,
            )
        except ChatFormatError as err:
            raise APIError(str(err), param=err.where) from None

    def chat_ids(self, body: ChatCompletionRequest | TokenizeRequest, mode: str, schema: Any) -> list[int]:
        return self.text_prompt(self.chat_prompt(body, mode, schema), add_bos=False, param="messages")

    # ---- the rest -------------------------------------------------------------------------------------
    async def tokenize(self, request: Request) -> Response:
        body = await self.parse(request, TokenizeRequest)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt")
        if body.prompt is not None:
            tokens = await self.offload(self.text_prompt, body.prompt, body.add_special_tokens)
        else:
            tokens = await self.offload(self.chat_ids, body, "auto" if body.tools else "none", None)
        result: dict[str, Any] = {
            "count": len(tokens),
            "max_model_len": self.engine.config.max_model_len,
            "tokens": tokens,
        }
        if body.return_token_strs:
            result["token_strs"] = [self.tokenizer.id_to_token(t) for t in tokens]
        return JSONResponse(result)

    async def detokenize(self, request: Request) -> Response:
        body = await self.parse(request, DetokenizeRequest)
        try:
            text = await self.offload(TextTokenizer(self.tokenizer).decode, body.tokens)
        except ValueError as err:
            raise APIError(str(err), param="tokens") from None
        return JSONResponse({"prompt": text})

    def model_card(self, name: str) -> dict[str, Any]:
        limit = self.engine.config.max_model_len
        return {"id": name, "object": "model", "created": self.created, "owned_by": "deepseek-ascend",
                "root": self.root, "parent": None, "max_model_len": limit}  # fmt: skip

    async def models(self, request: Request) -> Response:
        self.authorize(request)
        self.check_accepting()
        return JSONResponse({"object": "list", "data": [self.model_card(name) for name in self.names]})

    async def model(self, request: Request) -> Response:
        """`GET /v1/models/{id}`: one served name's card, 404 for any other."""
        self.authorize(request)
        name = request.path_params["model_id"]
        self.check_model(name)
        return JSONResponse(self.model_card(name))
