"""`POST /v1/completions`: text or token-id prompts in, text (and logprobs) out, streamed or not.

With `echo` and `logprobs` the logprobs cover the prompt's tokens too (the first one null: nothing comes
before it), then the completion's, as vLLM returns them (lm-eval's likelihood tasks read them);
`max_tokens: 0` with `echo` returns the prompt and its logprobs alone.
"""

from __future__ import annotations

import dataclasses
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
    prompt_only = body.prompt_only  # the engine still samples one token, which is dropped (as vLLM)
    for p in prompts:
        max_tokens = server.max_tokens(1 if prompt_only else body.max_tokens, p, "prompt")
        params = [
            body.sampling_params(
                max_tokens, body.logprobs, i, server.generation_defaults, body.prompt_logprobs_count()
            )
            for i in range(body.n)
        ]
        seqs += [(p, params[i], processors[i]) for i in range(body.n)]
    group = await server.submit("cmpl", seqs, "prompt")  # checks the token ids before echo decodes them
    texts = [p if isinstance(p, str) else server.tokenizer.decode(p) for p in body.prompts()]
    base = {"id": group.ids[0].rsplit("-", 1)[0], "object": "text_completion", "created": group.created,
            "model": body.model or server.names[0]}  # fmt: skip
    prompt_tokens = sum(len(p) for p in prompts)
    top = body.logprobs or 0
    echo_logprobs = body.echo and body.logprobs is not None  # the prompt's tokens lead the logprobs

    def generated(u: Update) -> Update:
        """What the client sees of an update: nothing of the dropped token when only the prompt is asked."""
        return dataclasses.replace(u, token_ids=[], logprobs=[], text="") if prompt_only else u

    def logprobs(u: Update, offset: int) -> dict | None:
        if body.logprobs is None:
            return None
        tokens = list(u.token_ids)
        entries: list[dict[int, float] | None] = [*u.logprobs]
        if echo_logprobs and u.prompt_logprobs is not None:  # the sequence's first update
            tokens[:0] = prompts[u.index // body.n]
            entries[:0] = [None, *(p.entries() for p in u.prompt_logprobs)]
        return server.texts.completion_logprobs(tokens, entries, top, offset)

    echo = [texts[i // body.n] if body.echo else "" for i in range(len(seqs))]
    if not body.stream:
        finals = [generated(u) for u in await server.collect(request, group)]
        choices = []
        for u in finals:
            choice = {
                "index": u.index,
                "text": echo[u.index] + u.text,
                "logprobs": logprobs(u, 0),
                "finish_reason": "length" if prompt_only else u.finish_reason,
            }
            if u.prompt_logprobs is not None:
                choice["prompt_logprobs"] = server.texts.prompt_logprobs(u.prompt_logprobs)
            choices.append(choice)
        cached = sum(u.cached_tokens for u in finals if u.index % body.n == 0)  # each prompt's first sequence
        usage = server.usage(prompt_tokens, sum(len(u.token_ids) for u in finals), cached)
        return JSONResponse({**base, "choices": choices, "usage": usage})

    include_usage, continuous = body.stream_usage()

    async def chunks() -> AsyncIterator[str]:
        releases = [TextRelease(sp.stop) for _, sp, _ in seqs]
        offsets = [0] * len(seqs)  # where each choice's next token starts in its text (by token texts)
        completion_tokens = cached = 0
        async for update in server.updates(group):
            u = generated(update)
            completion_tokens += len(u.token_ids)
            cached += u.cached_tokens if u.index % body.n == 0 else 0
            text = echo[u.index] + releases[u.index].next(u.text, u.finish_reason is not None)
            echo[u.index] = ""
            if not text and u.finish_reason is None and body.logprobs is None:
                continue
            lp = logprobs(u, offsets[u.index])
            if lp and lp["tokens"]:
                offsets[u.index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            finish = "length" if prompt_only and u.finish_reason else u.finish_reason
            choice = {"index": u.index, "text": text, "logprobs": lp, "finish_reason": finish}
            usage = server.usage(prompt_tokens, completion_tokens, cached) if continuous else None
            yield sse({**base, "choices": [choice], **({"usage": usage} if include_usage else {})})
        if include_usage:
            usage = server.usage(prompt_tokens, completion_tokens, cached)
            yield sse({**base, "choices": [], "usage": usage})

    return server.stream(group, chunks())
