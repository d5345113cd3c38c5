"""Offline generation in vLLM's shape: ``LLM(model=DIR).generate(prompts, sampling_params)`` and
``LLM.chat(messages)``, each result a ``RequestOutput`` with ``.outputs[i].text``; no model: the tiny V4.1.

A prompt is a text, a list of token ids, or vLLM's ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}``;
one prompt or a list. ``SamplingParams(n=K)`` gives K outputs per prompt, output i drawing from
``seed + i`` when seeded (as the server's choices do).
"""

from __future__ import annotations

import dataclasses
import sys
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from engine.config import EngineConfig, read_speculative_config
from engine.factory import default_model, start_engine
from engine.prompt_logprobs import Logprob, as_vllm
from engine.request import Request, SamplingParams
from model.chat import encode_messages
from model.chat_profile import select_chat_profile
from model.tokenizer import prompt_ids

Prompt = str | list[int] | dict[str, Any]
PROGRESS = "Processed prompts"


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    # With SamplingParams(prompt_logprobs=k): None for the first prompt token, then {token id: Logprob}.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class LLM:
    def __init__(
        self,
        model: str | Path | None = None,
        *,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        dtype: str | torch.dtype = "auto",
        device: str | None = None,
        quantization: str | None = None,
        speculative_config: dict[str, Any] | None = None,
        chat_encoding: str | None = None,
        trust_remote_code: bool = False,
        enforce_eager: bool = False,
        **engine_args: Any,
    ):
        """``engine_args`` are EngineConfig's fields (vLLM's names: ``max_model_len``, ``max_num_seqs``,
        ``max_num_batched_tokens``, ``block_size``, ``seed``, ...); ``dtype`` auto is bfloat16 on npu / cuda
        and float32 on cpu, ``device`` defaults to the accelerator present, ``quantization`` is the
        checkpoint's own format (``fp8``, ``ascend``; None: whatever it stores) or ``w8a8`` (requantise an FP8
        checkpoint to int8 at load); ``enforce_eager`` turns the decode graphs off (CUDA / NPU);
        ``trust_remote_code`` is accepted as vLLM's and changes nothing here. ``tensor_parallel_size``
        N > 1 spawns N - 1 worker processes (``close()`` ends them). ``data_parallel_size`` D > 1 (with
        ``enable_expert_parallel``) runs D engines, one process each, the routed experts split over them."""
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        if unknown := sorted(set(engine_args) - known):
            raise ValueError(f"unknown engine arguments {unknown}; known: {sorted(known)}")
        if speculative_config is not None:
            method, tokens = read_speculative_config(speculative_config, "speculative_config")
            engine_args["speculative_method"], engine_args["num_speculative_tokens"] = method, tokens
        model = default_model() if model is None else model
        config = EngineConfig(
            tensor_parallel_size=tensor_parallel_size,
            data_parallel_size=data_parallel_size,
            enable_expert_parallel=enable_expert_parallel,
            enforce_eager=enforce_eager,
            **engine_args,
        )
        started = start_engine(model, config, device, dtype, quantization)
        self.engine, self.workers = started.engine, started.workers
        if self.workers:
            weakref.finalize(self, self.workers.close)
        built = self.engine.model
        self.chat_profile = select_chat_profile(built.cfg.model_type, Path(model), chat_encoding)

    def close(self) -> None:
        """End the tensor-parallel workers, if any (also done when the LLM is garbage-collected)."""
        if self.workers:
            self.workers.close()

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order."""
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = _as_list(prompts, "prompts")
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
            params = sampling_params
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        for sp in params:
            if not isinstance(sp, SamplingParams):
                raise ValueError(
                    f"sampling_params: a SamplingParams or a list of them, not {type(sp).__name__}"
                )
        texts, ids = zip(*(self._prompt(p) for p in prompts), strict=True) if prompts else ((), ())
        groups: list[list[Request]] = []
        try:
            for prompt, sp in zip(ids, params, strict=True):
                groups.append(self._add(prompt, sp))
            self._run([r for group in groups for r in group], use_tqdm)
        except BaseException:  # an invalid prompt or an interrupt leaves nothing behind in the engine
            for request in (r for group in groups for r in group):
                self.engine.abort(request.id)
                self.engine.completion(request)
            raise
        return [self._output(*parts) for parts in zip(texts, ids, groups, strict=True)]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate for one conversation or a list of them, rendered with the checkpoint's chat encoding;
        the outputs' text is the model's raw reply (reasoning and tool calls unparsed), as vLLM's."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        kwargs = chat_template_kwargs or {}
        if not isinstance(kwargs.get("thinking", False), bool):
            raise ValueError(f"chat_template_kwargs thinking={kwargs['thinking']!r} must be true or false")
        rendered = [
            encode_messages(
                conversation,
                profile=self.chat_profile,
                tools=tools,
                thinking=bool(kwargs.get("thinking", kwargs.get("reasoning_effort") is not None)),
                reasoning_effort=kwargs.get("reasoning_effort"),
                add_generation_prompt=add_generation_prompt,
            )
            for conversation in conversations
        ]
        return self.generate(rendered, sampling_params, use_tqdm)

    def _prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """The text and the ids of a prompt; the engine checks the ids against the vocabulary."""
        engine = self.engine
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _as_list(prompt["prompt_token_ids"], "prompt_token_ids")
            if "prompt" not in prompt:
                raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', not {sorted(prompt)}")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, prompt_ids(engine.tokenizer, prompt, engine.model.cfg.bos_token_id)
        return None, _as_list(prompt, "prompt")

    def _add(self, prompt: list[int], params: SamplingParams) -> list[Request]:
        """The prompt's n sequences: sequence i draws from seed + i; no max_tokens fills the context."""
        n, seed, max_tokens = params.n, params.seed, params.max_tokens
        if max_tokens is None:  # at least one: a prompt that fills the context is refused naming both
            max_tokens = max(1, self.engine.config.max_model_len - len(prompt))
        return [
            self.engine.add_request(
                prompt,
                dataclasses.replace(
                    params, n=1, seed=None if seed is None else seed + i, max_tokens=max_tokens
                ),
            )
            for i in range(n)
        ]

    def _run(self, requests: list[Request], use_tqdm: bool) -> None:
        """Step until done, with a progress bar redrawn at most four times a second on a terminal; where
        stderr is no terminal (CI logs, pipes) the bar is written once, at the end."""
        engine, started, live = self.engine, time.monotonic(), sys.stderr.isatty()
        with tqdm(
            total=len(requests), desc=PROGRESS, disable=not (use_tqdm and live), mininterval=0.25
        ) as bar:
            while engine.has_work:
                engine.step()
                bar.update(sum(r.finished for r in requests) - bar.n)
        if use_tqdm and not live:
            done = sum(r.finished for r in requests)
            print(
                tqdm.format_meter(done, len(requests), time.monotonic() - started, prefix=PROGRESS),
                file=sys.stderr,
            )

    def _output(self, text: str | None, prompt: list[int], requests: list[Request]) -> RequestOutput:
        outputs, scored = [], None
        for i, request in enumerate(requests):
            done = self.engine.completion(request)
            outputs.append(CompletionOutput(i, done.text, done.token_ids, done.finish_reason, done.logprobs))
            scored = done.prompt_logprobs if scored is None else scored
        prompt_logprobs = None if scored is None else as_vllm(scored, self.engine.tokenizer)
        return RequestOutput(requests[0].id, text, prompt, outputs, prompt_logprobs=prompt_logprobs)


def _as_list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list | tuple):
        kinds = "a text, a list of token ids, a dict or a list of these"
        raise ValueError(f"{name}={repr(value)[:60]}: must be {kinds}, not {type(value).__name__}")
    return list(value)
