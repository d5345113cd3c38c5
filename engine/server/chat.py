"""`POST /v1/chat/completions`: the checkpoint's chat encoding in, reasoning / content / tool calls out.

A streamed choice and a non-streamed one pass through the same ChatChoice (the latter fed its final text
at once), so the concatenated stream is the non-streamed message. `response_format` and a forced
`tool_choice` are enforced by constrained decoding (engine/grammar.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.grammar import GrammarError
from engine.server.api import OpenAIServer, Seq, sse
from engine.server.async_engine import Group, Update
from engine.server.output import ChatChoice
from engine.server.protocol import APIError, ChatCompletionRequest
from model.chat_parse import StreamDelta


def _delta(d: StreamDelta) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if d.reasoning_content:  # under both names: current vLLM's `reasoning` and the older one
        out["reasoning"] = out["reasoning_content"] = d.reasoning_content
    if d.content:
        out["content"] = d.content
    if d.tool_calls:
        out["tool_calls"] = [{"index": k, **c.to_openai()} for k, c in enumerate(d.tool_calls)]
    return out


@dataclass
class ChatRun:
    """A chat request admitted to the engine: its group, prompt and one ChatChoice per sequence."""

    group: Group
    prompt: list[int]
    choices: list[ChatChoice]
    top: int | None  # top logprobs per token, None: no logprobs


async def start_chat(server: OpenAIServer, body: ChatCompletionRequest, prefix: str = "chatcmpl") -> ChatRun:
    """Encode, tokenise, build the grammar and submit: what /v1/chat/completions and /v1/responses share."""
    body.check()
    mode, named = body.tool_mode()
    schema = body.json_schema()
    if schema is not None and mode in ("required", "named"):
        raise APIError("response_format cannot be combined with a forced tool call", param="tool_choice")
    top = body.logprobs_count()
    prompt = await server.offload(server.chat_ids, body, mode, schema)
    max_tokens = server.max_tokens(body.requested_max_tokens(), prompt, "messages")
    param = "response_format" if schema is not None else "tool_choice"
    try:
        if schema is not None:
            grammar = server.grammars.json(schema, body.thinking)
        elif mode in ("required", "named"):
            grammar = server.grammars.tool_calls(
                body.tools or [], named, body.thinking, body.parallel_tool_calls, server.chat
            )
        else:
            grammar = None
    except GrammarError as err:
        raise APIError(str(err), param=param) from None
    processors = await server.processors(grammar, body, param, body.reasoning_budget())
    seqs: list[Seq] = [
        (
            prompt,
            body.sampling_params(max_tokens, top, i, server.generation_defaults, body.prompt_logprobs),
            processors[i],
        )
        for i in range(body.n)
    ]
    limit_param = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
    group = await server.submit(prefix, seqs, "messages", limit_param)
    choices = [ChatChoice(params.stop, body.thinking, mode != "none", server.chat) for _, params, _ in seqs]
    return ChatRun(group, prompt, choices, top)


async def chat_completions(server: OpenAIServer, request: Request) -> Response:
    body = await server.parse(request, ChatCompletionRequest)
    run = await start_chat(server, body)
    group, prompt, choices, top = run.group, run.prompt, run.choices, run.top
    base = {"id": group.ids[0].rsplit("-", 1)[0], "object": "chat.completion", "created": group.created,
            "model": body.model or server.names[0]}  # fmt: skip

    def logprobs(u: Update) -> dict | None:
        return None if top is None else {"content": server.texts.chat_logprobs(u.token_ids, u.logprobs, top)}

    if not body.stream:
        out = []
        finals = await server.collect(request, group)
        for u in finals:
            d, finish = choices[u.index].advance(u.text, u.finish_reason)
            message: dict[str, Any] = {"role": "assistant", "content": d.content}
            if body.thinking:
                message["reasoning"] = message["reasoning_content"] = d.reasoning_content
            if d.tool_calls:
                message["tool_calls"] = [c.to_openai() for c in d.tool_calls]
                message["content"] = d.content or None
            out.append(
                {"index": u.index, "message": message, "logprobs": logprobs(u), "finish_reason": finish}
            )
        cached = max((u.cached_tokens for u in finals), default=0)
        usage = server.usage(len(prompt), sum(len(u.token_ids) for u in finals), cached)
        scored = finals[0].prompt_logprobs  # vLLM's: once per response, beside the choices
        extra = {} if scored is None else {"prompt_logprobs": server.texts.prompt_logprobs(scored)}
        return JSONResponse({**base, "choices": out, "usage": usage, **extra})

    include_usage, continuous = body.stream_usage()
    base["object"] = "chat.completion.chunk"
    generated = cached = 0

    def chunk(index: int, delta: dict, lp: dict | None = None, finish: str | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        usage = server.usage(len(prompt), generated, cached) if continuous else None
        return sse({**base, "choices": [choice], **({"usage": usage} if include_usage else {})})

    async def chunks() -> AsyncIterator[str]:
        nonlocal generated, cached
        for i in range(len(choices)):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for u in server.updates(group):
            generated += len(u.token_ids)
            cached = max(cached, u.cached_tokens)
            d, finish = choices[u.index].advance(u.text, u.finish_reason)
            delta = _delta(d)
            if delta or (u.token_ids and top is not None):
                yield chunk(u.index, delta, logprobs(u))
            if finish is not None:
                yield chunk(u.index, {}, None, finish)
        if include_usage:
            yield sse({**base, "choices": [], "usage": server.usage(len(prompt), generated, cached)})

    return server.stream(group, chunks())
