"""`POST /v1/completions`: text or token-id prompts in, text (and logprobs) out, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.server.api import OpenAIServer, Seq, sse
from engine.server.async_engine import Update
from engine.server.output import TextRelease
from engine.server.protocol import CompletionRequest


async def completions(server: OpenAIServer, request: Request) -> Response:
    body = await server.parse(request, CompletionRequest)
    body.check()
    prompts = await server.offload(
        lambda: [server.text_prompt(p) if isinstance(p, str) else p for p in body.prompts()]
    )
    processors = await server.processors(None, body)
    seqs: list[Seq] = []
    for p in prompts:
        max_tokens = server.max_tokens(body.max_tokens, p, "prompt")
        params = [
            body.sampling_params(max_tokens, body.logprobs, i, server.generation_defaults)
            for i in range(body.n)
        ]
        seqs += [(p, params[i], processors[i]) for i in range(body.n)]
    group = await server.submit("cmpl", seqs, "prompt")  # checks the token ids before echo decodes them
    texts = [p if isinstance(p, str) else server.tokenizer.decode(p) for p in body.prompts()]
    base = {"id": group.ids[0].rsplit("-", 1)[0], "object": "text_completion", "created": group.created,
            "model": body.model or server.names[0]}  # fmt: skip
    prompt_tokens = sum(len(p) for p in prompts)
    top = body.logprobs or 0

    def logprobs(u: Update, offset: int) -> dict | None:
        if body.logprobs is None:
            return None
        return server.texts.completion_logprobs(u.token_ids, u.logprobs, top, offset)

    echo = [texts[i // body.n] if body.echo else "" for i in range(len(seqs))]
    if not body.stream:
        finals = await server.collect(request, group)
        choices = [
            {
                "index": u.index,
                "text": echo[u.index] + u.text,
                "logprobs": logprobs(u, len(echo[u.index])),
                "finish_reason": u.finish_reason,
            }
            for u in finals
        ]
        cached = sum(u.cached_tokens for u in finals if u.index % body.n == 0)  # each prompt's first sequence
        usage = server.usage(prompt_tokens, sum(len(u.token_ids) for u in finals), cached)
        return JSONResponse({**base, "choices": choices, "usage": usage})

    include_usage, continuous = body.stream_usage()

    async def chunks() -> AsyncIterator[str]:
        releases = [TextRelease(sp.stop) for _, sp, _ in seqs]
        offsets = [len(e) for e in echo]
        generated = cached = 0
        async for u in server.updates(group):
            generated += len(u.token_ids)
            cached += u.cached_tokens if u.index % body.n == 0 else 0
            text = echo[u.index] + releases[u.index].next(u.text, u.finish_reason is not None)
            echo[u.index] = ""
            if not text and u.finish_reason is None and body.logprobs is None:
                continue
            lp = logprobs(u, offsets[u.index])
            offsets[u.index] += len(text)
            choice = {"index": u.index, "text": text, "logprobs": lp, "finish_reason": u.finish_reason}
            usage = server.usage(prompt_tokens, generated, cached) if continuous else None
            yield sse({**base, "choices": [choice], **({"usage": usage} if include_usage else {})})
        if include_usage:
            yield sse({**base, "choices": [], "usage": server.usage(prompt_tokens, generated, cached)})

    return server.stream(group, chunks())
