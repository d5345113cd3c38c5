"""The OpenAI API over the async engine: request checks, completions, tokenize, detokenize, models.

Chat completions live in engine/openai_chat.py; the app and the command line in engine/serve.py.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from engine.async_engine import AsyncEngine, Group, Update
from engine.grammar import GrammarError, Grammars, LogitBias, chain
from engine.llm_engine import LLMEngine
from engine.metrics import Metrics
from engine.openai_output import TextRelease, TokenTexts
from engine.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    Sampling,
    TokenizeRequest,
    validation_error,
)
from engine.request import LogitsProcessor, SamplingParams
from model.chat import ChatFormatError, encode_messages, loads_strict
from model.tokenizer import TextTokenizer, prompt_ids

M = TypeVar("M", bound=BaseModel)
Seq = tuple[list[int], SamplingParams, LogitsProcessor | None]  # prompt, params, processor of a sequence


def sse(obj: object) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class OpenAIServer:
    def __init__(self, engine: LLMEngine, names: list[str], api_key: str | None = None, root: str = ""):
        self.engine, self.names, self.api_key, self.root = engine, names, api_key, root
        self.tokenizer = engine.tokenizer
        self.cfg = engine.model.cfg
        self.metrics = Metrics(names[0])
        self.core = AsyncEngine(engine, self.metrics)
        self.grammars = Grammars(self.tokenizer, self.cfg.vocab_size, self.cfg.eos_token_id)
        self.texts = TokenTexts(self.tokenizer)
        self.created = int(time.time())

    # ---- request checks -------------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise APIError("invalid or missing API key", 401, code="invalid_api_key")

    async def parse(self, request: Request, model: type[M]) -> M:
        self.authorize(request)
        try:
            data = loads_strict((await request.body()).decode())
        except (ValueError, UnicodeDecodeError) as err:
            raise APIError(f"the request body is not valid JSON: {err}") from None
        if not isinstance(data, dict):
            raise APIError("the request body must be a JSON object")
        try:
            parsed = model.model_validate(data)
        except ValidationError as err:
            raise validation_error(err) from None
        name = getattr(parsed, "model", None)
        if name is not None and name not in self.names:
            raise APIError(f"the model {name!r} does not exist", 404, param="model", code="model_not_found")
        return parsed

    def text_prompt(self, text: str, add_bos: bool = True) -> list[int]:
        return prompt_ids(self.tokenizer, text, self.cfg.bos_token_id, add_bos)

    def max_tokens(self, requested: int | None, prompt: list[int], param: str) -> int:
        room = self.engine.config.max_model_len - len(prompt)
        if room < 1:
            limit = self.engine.config.max_model_len
            raise APIError(f"the prompt has {len(prompt)} tokens; the context limit is {limit}", param=param)
        return requested if requested is not None else room

    async def processors(
        self, grammar: str | None, body: Sampling, param: str | None = None
    ) -> list[LogitsProcessor | None]:
        bias = body.token_bias(self.cfg.vocab_size)
        grammar_processors: list[Any] = [None] * body.n
        if grammar is not None:
            try:  # compiling a large schema takes a while: keep the event loop free
                grammar_processors = await asyncio.to_thread(self.grammars.processors, grammar, body.n)
            except GrammarError as err:
                raise APIError(str(err), param=param) from None
        return [chain(LogitBias(bias) if bias else None, g) for g in grammar_processors]

    async def submit(self, prefix: str, seqs: list[Seq]) -> Group:
        try:
            return await self.core.add(f"{prefix}-{uuid.uuid4().hex}", seqs)
        except ValueError as err:
            raise APIError(str(err)) from None

    # ---- driving a group ------------------------------------------------------------------------------
    async def updates(self, group: Group) -> AsyncIterator[Update]:
        done = 0
        while done < len(group.ids):
            update = await group.updates.get()
            if update.finish_reason == "error":
                raise APIError(update.error or "engine error", 500)
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

    def stream(self, group: Group, chunks: AsyncIterator[str]) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            try:
                async for chunk in chunks:
                    yield chunk
            except APIError as err:
                yield sse(err.body())
            finally:  # also when the client disconnected and the response task was cancelled
                self.core.abort(group)
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    def usage(self, prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        total = prompt_tokens + completion_tokens
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total}

    # ---- /v1/completions -----------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        body = await self.parse(request, CompletionRequest)
        body.check_stream_options()
        prompts = [self.text_prompt(p) if isinstance(p, str) else p for p in body.prompts()]
        processors = await self.processors(None, body)
        seqs: list[Seq] = []
        for p in prompts:
            max_tokens = self.max_tokens(body.max_tokens, p, "prompt")
            seqs += [
                (p, body.sampling_params(max_tokens, body.logprobs, i), processors[i]) for i in range(body.n)
            ]
        group = await self.submit("cmpl", seqs)  # checks the token ids before they are decoded for echo
        texts = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in body.prompts()]
        base = {"id": group.ids[0].rsplit("-", 1)[0], "object": "text_completion", "created": group.created,
                "model": body.model or self.names[0]}  # fmt: skip
        prompt_tokens = sum(len(p) for p in prompts)
        top = body.logprobs or 0

        def logprobs(u: Update, offset: int) -> dict | None:
            if body.logprobs is None:
                return None
            return self.texts.completion_logprobs(u.token_ids, u.logprobs, top, offset)

        echo = [texts[i // body.n] if body.echo else "" for i in range(len(seqs))]
        if not body.stream:
            finals = await self.collect(request, group)
            choices = [
                {
                    "index": u.index,
                    "text": echo[u.index] + u.text,
                    "logprobs": logprobs(u, len(echo[u.index])),
                    "finish_reason": u.finish_reason,
                }
                for u in finals
            ]
            usage = self.usage(prompt_tokens, sum(len(u.token_ids) for u in finals))
            return JSONResponse({**base, "choices": choices, "usage": usage})

        include_usage = body.stream_options is not None and body.stream_options.include_usage

        async def chunks() -> AsyncIterator[str]:
            releases = [TextRelease(sp.stop) for _, sp, _ in seqs]
            offsets = [len(e) for e in echo]
            generated = 0
            async for u in self.updates(group):
                generated += len(u.token_ids)
                text = echo[u.index] + releases[u.index].next(u.text, u.finish_reason is not None)
                echo[u.index] = ""
                if not text and u.finish_reason is None and body.logprobs is None:
                    continue
                lp = logprobs(u, offsets[u.index])
                offsets[u.index] += len(text)
                choice = {"index": u.index, "text": text, "logprobs": lp, "finish_reason": u.finish_reason}
                yield sse({**base, "choices": [choice], **({"usage": None} if include_usage else {})})
            if include_usage:
                yield sse({**base, "choices": [], "usage": self.usage(prompt_tokens, generated)})

        return self.stream(group, chunks())

    # ---- /v1/chat/completions ------------------------------------------------------------------------
    def chat_prompt(self, body: ChatCompletionRequest | TokenizeRequest, mode: str, schema: Any) -> str:
        kwargs = body.chat_template_kwargs
        try:
            return encode_messages(
                # Clients send unset optional fields as null (e.g. a returned assistant message's refusal).
                [
                    {k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m
                    for m in body.messages or []
                ],
                tools=body.tools if mode != "none" else None,
                thinking=body.thinking,
                reasoning_effort=body.reasoning_effort,
                response_format=schema,  # shown to the model in the system section
                add_generation_prompt=getattr(body, "add_generation_prompt", True),
                drop_thinking=kwargs.drop_thinking if kwargs else True,
            )
        except ChatFormatError as err:
            raise APIError(str(err), param=err.where) from None

    # ---- the rest -------------------------------------------------------------------------------------
    async def tokenize(self, request: Request) -> Response:
        body = await self.parse(request, TokenizeRequest)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt")
        if body.prompt is not None:
            tokens = self.text_prompt(body.prompt, body.add_special_tokens)
        else:
            mode = "auto" if body.tools else "none"
            tokens = self.tokenizer.encode(self.chat_prompt(body, mode, None), add_special_tokens=False).ids
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
            text = TextTokenizer(self.tokenizer).decode(body.tokens)
        except ValueError as err:
            raise APIError(str(err), param="tokens") from None
        return JSONResponse({"prompt": text})

    async def models(self, request: Request) -> Response:
        self.authorize(request)
        data = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "deepseek-ascend",
                "root": self.root,
                "max_model_len": self.engine.config.max_model_len,
            }
            for name in self.names
        ]
        return JSONResponse({"object": "list", "data": data})
