"""`POST /v1/responses`: OpenAI's Responses API for text in and out, streamed or not.

The request becomes a chat request (engine/server/chat.py runs it); the reply is a `reasoning` item (when
thinking) and a `message` item with one `output_text` part. Streams send the Responses events, each
`event: TYPE` with its `sequence_number`, from `response.created` to `response.completed`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.server.api import OpenAIServer
from engine.server.chat import start_chat
from engine.server.protocol import APIError, ResponsesRequest


def _event(kind: str, number: int, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': number, **fields})}\n\n"


class _Reply:
    """The response object as it grows: its reasoning and text, then its status and usage."""

    def __init__(self, body: ResponsesRequest, model: str, input_tokens: int):
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())
        self.reasoning_id, self.message_id = f"rs_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.body, self.model, self.input_tokens = body, model, input_tokens
        self.reasoning = self.text = ""
        self.output_tokens, self.cached_tokens, self.status, self.finish = 0, 0, "in_progress", None

    def reasoning_item(self) -> dict[str, Any]:
        content = [{"type": "reasoning_text", "text": self.reasoning}]
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [], "content": content}

    def message_item(self, status: str) -> dict[str, Any]:
        part = {"type": "output_text", "text": self.text, "annotations": []}
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [part] if status != "in_progress" else []}  # fmt: skip

    def object(self, with_output: bool = True) -> dict[str, Any]:
        output = ([self.reasoning_item()] if self.reasoning else []) + [self.message_item(self.status)]
        incomplete = {"reason": "max_output_tokens"} if self.finish == "length" else None
        usage = {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                 "total_tokens": self.input_tokens + self.output_tokens,
                 "input_tokens_details": {"cached_tokens": self.cached_tokens},
                 "output_tokens_details": {"reasoning_tokens": 0}}  # fmt: skip
        body = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": self.status,
                "model": self.model, "output": output if with_output else [],
                "instructions": body.instructions,
                "max_output_tokens": body.max_output_tokens, "temperature": body.temperature,
                "top_p": body.top_p, "parallel_tool_calls": False, "tool_choice": "none", "tools": [],
                "metadata": {}, "error": None, "incomplete_details": incomplete,
                "usage": usage if self.status != "in_progress" else None}  # fmt: skip

    def end(self, finish: str | None) -> None:
        self.finish = finish
        self.status = "incomplete" if finish == "length" else "completed"


async def responses(server: OpenAIServer, request: Request) -> Response:
    body = await server.parse(request, ResponsesRequest)
    chat = body.chat_request()
    run = await start_chat(server, chat, "resp")
    choice = run.choices[0]
    reply = _Reply(body, body.model or server.names[0], len(run.prompt))

    if not body.stream:
        (final,) = await server.collect(request, run.group)
        delta, finish = choice.advance(final.text, final.finish_reason)
        reply.reasoning, reply.text, reply.output_tokens, reply.cached_tokens = (
            delta.reasoning_content,
            delta.content,
            len(final.token_ids),
            final.cached_tokens,
        )
        reply.end(finish)
        return JSONResponse(reply.object())

    async def events() -> AsyncIterator[str]:
        number = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal number
            number += 1
            return _event(kind, number - 1, **fields)

        yield event("response.created", response=reply.object(with_output=False))
        yield event("response.in_progress", response=reply.object(with_output=False))
        reasoning_open, text_at = False, None  # text_at: where the message's text part is, once open
        empty = {"type": "output_text", "text": "", "annotations": []}
        async for u in server.updates(run.group):
            reply.output_tokens += len(u.token_ids)
            reply.cached_tokens = max(reply.cached_tokens, u.cached_tokens)
            delta, finish = choice.advance(u.text, u.finish_reason)
            if delta.reasoning_content:
                if not reasoning_open:
                    reasoning_open = True
                    yield event("response.output_item.added", output_index=0, item=reply.reasoning_item())
                reply.reasoning += delta.reasoning_content
                yield event("response.reasoning_text.delta", item_id=reply.reasoning_id, output_index=0,
                            content_index=0, delta=delta.reasoning_content)  # fmt: skip
            if (delta.content or finish is not None) and text_at is None:
                if reasoning_open:
                    yield event("response.reasoning_text.done", item_id=reply.reasoning_id, output_index=0,
                                content_index=0, text=reply.reasoning)  # fmt: skip
                    yield event("response.output_item.done", output_index=0, item=reply.reasoning_item())
                text_at = {
                    "item_id": reply.message_id,
                    "output_index": int(reasoning_open),
                    "content_index": 0,
                }
                item = reply.message_item("in_progress")
                yield event("response.output_item.added", output_index=text_at["output_index"], item=item)
                yield event("response.content_part.added", **text_at, part=empty)
            if delta.content:
                reply.text += delta.content
                yield event("response.output_text.delta", **text_at, delta=delta.content)
            if finish is not None:
                reply.end(finish)
                part = {"type": "output_text", "text": reply.text, "annotations": []}
                yield event("response.output_text.done", **text_at, text=reply.text)
                yield event("response.content_part.done", **text_at, part=part)
                item = reply.message_item(reply.status)
                yield event("response.output_item.done", output_index=text_at["output_index"], item=item)
                kind = "response.incomplete" if reply.status == "incomplete" else "response.completed"
                yield event(kind, response=reply.object())

    def error_event(err: APIError) -> str:
        return _event("error", 0, code=err.code, message=err.message, param=err.param)

    return server.stream(run.group, events(), error_event, end="")
