"""Prompt logprobs over HTTP, as lm-eval's likelihood tasks read them: `echo` + `logprobs` on
/v1/completions (the prompt's tokens first, the first one null), `max_tokens: 0`, vLLM's `prompt_logprobs`
field on both endpoints, each value equal to the model's cache-free forward through chunked prefill and a
prefix-cache hit; and HEAD on the probe routes."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import torch

from model.checkpoint import load_model
from model.testing.tiny import cached_tiny
from tests.engine.test_prompt_logprobs import TOL, rank_fits
from tests.server.conftest import MODEL, Served, serving

PAGE = {"v4": 128, "v41": 32}  # the smallest prefix page each tiny model allows


@pytest.fixture(scope="module", params=["v4", "v41"])
def tiny(request, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Served, object]]:
    """A server with chunks of 16 tokens and the smallest prefix page, and the model it serves."""
    arch = request.param
    path = cached_tiny(arch)
    flags = ["--model", str(path), "--served-model-name", MODEL, "--max-model-len", "512",
             "--max-num-batched-tokens", "16", "--prefix-page-size", str(PAGE[arch]), "--torch-threads", "1",
             "--log-level", "warning"]  # fmt: skip
    with serving(tmp_path_factory.mktemp(f"logprobs-{arch}") / "server.log", *flags) as (served, _):
        yield arch, served, load_model(path)


def random_tokens(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(prompt)).float().log_softmax(dim=-1)[:-1]


def complete(served: Served, **body) -> dict:
    with served.http() as http:
        response = http.post("/v1/completions", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def vllm_field_error(field: list, prompt: list[int], logp: torch.Tensor, top: int) -> float:
    """The largest difference of vLLM's `prompt_logprobs` to the reference, after checking its shape:
    per token the token itself and the ``top`` best, each with its rank and text."""
    assert len(field) == len(prompt) and field[0] is None
    worst = 0.0
    for q, entry in enumerate(field[1:]):
        row, token = logp[q], prompt[q + 1]
        assert int(next(iter(entry))) == token and len(set(map(int, entry)) - {token}) in (top - 1, top)
        for key, lp in entry.items():
            assert rank_fits(lp["rank"], row, int(key)) and isinstance(lp["decoded_token"], str)
            worst = max(worst, abs(lp["logprob"] - float(row[int(key)])))
        best = sorted((lp["logprob"] for lp in entry.values()), reverse=True)[:top]
        worst = max([worst, *(abs(v - w) for v, w in zip(best, row.topk(top).values.tolist(), strict=True))])
    return worst


def test_echo_logprobs_score_the_prompt_as_lm_eval_asks(tiny):
    """lm-eval's request: token ids, max_tokens 1, logprobs 1, echo. One entry per prompt token (the first
    null) then the generated one; the prompt's equal the cache-free forward, chunked by 16."""
    arch, served, model = tiny
    prompt = random_tokens(model.cfg.vocab_size, 45, 1)
    choice = complete(served, prompt=prompt, max_tokens=1, logprobs=1, echo=True, temperature=0)["choices"][0]
    lp, logp = choice["logprobs"], reference(model, prompt)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(prompt) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    got = torch.tensor(lp["token_logprobs"][1 : len(prompt)], dtype=torch.float64)
    want = logp.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].double()
    assert float((got - want).abs().max()) < TOL
    best = torch.tensor(
        [max(top.values()) for top in lp["top_logprobs"][1 : len(prompt)]], dtype=torch.float64
    )
    assert float((best - logp.max(dim=-1).values.double()).abs().max()) < TOL
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and all(
        offsets[i + 1] == offsets[i] + len(lp["tokens"][i]) for i in range(len(offsets) - 1)
    )
    assert vllm_field_error(choice["prompt_logprobs"], prompt, logp, 1) < TOL


def test_prefix_cache_hit_keeps_every_prompt_logprob(tiny):
    """A prompt whose two leading pages the cache holds is recomputed: all its logprobs, none cached."""
    arch, served, model = tiny
    shared = random_tokens(model.cfg.vocab_size, 2 * PAGE[arch], 2)
    complete(served, prompt=shared + [7, 8], max_tokens=1)
    prompt = shared + [9, 10, 11]
    out = complete(served, prompt=prompt, max_tokens=1, logprobs=0, echo=True)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    got = torch.tensor(out["choices"][0]["logprobs"]["token_logprobs"][1 : len(prompt)], dtype=torch.float64)
    logp = reference(model, prompt)
    want = logp.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].double()
    assert float((got - want).abs().max()) < TOL
    again = complete(served, prompt=prompt + [12], max_tokens=1)  # its pages were published
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * PAGE[arch]


def test_echo_with_max_tokens_0_returns_the_prompt_alone(tiny):
    arch, served, model = tiny
    text = "Hello there, how are you"
    out = complete(served, prompt=text, max_tokens=0, logprobs=2, echo=True)
    choice = out["choices"][0]
    ids = out["usage"]["prompt_tokens"]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0
    assert len(choice["logprobs"]["tokens"]) == ids and choice["logprobs"]["token_logprobs"][0] is None
    assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"][1:])
    with served.http() as http:
        refused = http.post("/v1/completions", json={"prompt": text, "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_stream_echo_logprobs_equal_the_non_streamed(tiny):
    arch, served, model = tiny
    prompt = random_tokens(model.cfg.vocab_size, 20, 3)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "logprobs": 1, "echo": True, "temperature": 0}
    whole = complete(served, **body)["choices"][0]["logprobs"]
    pieces: dict[str, list] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    with served.http() as http, http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                lp = httpx.Response(200, content=line[6:]).json()["choices"][0]["logprobs"]
                for key in pieces:
                    pieces[key] += lp[key]
    assert pieces["tokens"] == whole["tokens"] and pieces["text_offset"] == whole["text_offset"]
    assert pieces["token_logprobs"][0] is None
    assert torch.allclose(
        torch.tensor(pieces["token_logprobs"][1:]), torch.tensor(whole["token_logprobs"][1:]), atol=TOL
    )


def test_prompt_logprobs_field_on_both_endpoints(tiny):
    """vLLM's `prompt_logprobs`: per completion choice, and once beside the chat choices; refused when
    streamed (as vLLM)."""
    arch, served, model = tiny
    prompt = random_tokens(model.cfg.vocab_size, 24, 4)
    choice = complete(served, prompt=prompt, max_tokens=1, prompt_logprobs=2)["choices"][0]
    assert choice["logprobs"] is None
    assert vllm_field_error(choice["prompt_logprobs"], prompt, reference(model, prompt), 2) < TOL
    messages = [{"role": "user", "content": "Score me"}]
    with served.http() as http:
        chat = http.post(
            "/v1/chat/completions", json={"messages": messages, "max_tokens": 1, "prompt_logprobs": 1}
        )
        ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
        streamed = http.post(
            "/v1/chat/completions", json={"messages": messages, "prompt_logprobs": 1, "stream": True}
        )
    assert chat.status_code == 200, chat.text
    assert vllm_field_error(chat.json()["prompt_logprobs"], ids, reference(model, ids), 1) < TOL
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"
    with served.http() as http:
        too_many = http.post("/v1/completions", json={"prompt": prompt, "prompt_logprobs": 21})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt_logprobs"


def test_head_on_the_probe_routes(tiny):
    arch, served, model = tiny
    with served.http() as http:
        for path in ("/metrics", "/health", "/v1/models"):
            assert http.head(path).status_code == 200, path
