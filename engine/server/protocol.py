"""OpenAI request schemas, validated strictly: a wrong type or an out-of-range value is a 400 naming the
field and the value, never a 500 and never silently coerced; only what JSON itself leaves open is read
as the client meant it: null is an unset field, a whole float (`5.0`) an integer.

Unknown fields are accepted and ignored, as vLLM does (its request models allow extras at every level; the
server logs their names), so clients that send `metadata`, `store`, fields of newer APIs or extras inside
`stream_options` and `response_format` keep working; fields that would change the output and are not
implemented (`UNSUPPORTED`, and any other kind of `structured_outputs`) are refused unless they hold their
neutral value.

Beyond OpenAI, as vLLM: `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`,
`stop_token_ids`, `skip_special_tokens`, `include_stop_str_in_output`, `prompt_logprobs`, `guided_json` /
`structured_outputs.json`, and for chat `add_generation_prompt` and `chat_template_kwargs` (`thinking`,
`reasoning_effort`; `reasoning_effort` alone also turns thinking on).
"""

from __future__ import annotations

import functools
import json
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from engine.request import (
    FLOAT32_TINY,
    MAX_LOGPROBS,
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    SEED_RANGE,
    SamplingParams,
)

MAX_SEQUENCES_PER_REQUEST = 64  # prompts x n of one completions request
# What a checkpoint's generation_config.json may set for the requests that leave it unset.
GENERATION_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
MAX_LOGIT_BIAS = 1024  # entries


class APIError(Exception):
    """An OpenAI-style error response."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        # A 404's type is vLLM's (a client switching from it may test for it); the others are OpenAI's.
        kind = {401: "authentication_error", 404: "NotFoundError"}.get(self.status, "invalid_request_error")
        if self.status >= 500:
            kind = "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def _is_branch_tag(part: object) -> bool:
    """pydantic puts the name of the union member it tried into an error's location (`str`,
    `list[int]`, `NamedToolChoice`, `literal[...]`): not a field a client could name."""
    if not isinstance(part, str):
        return False
    return not part.isidentifier() or part[:1].isupper() or part in ("str", "int", "float", "bool", "none")


def validation_error(err: ValidationError) -> APIError:
    """The error of the union member that matched the input furthest (a list of 100,000 stop strings is
    "too many items", not "not a string"), located by field names alone."""

    def path(e: Any) -> list[object]:
        return [p for p in e["loc"] if not _is_branch_tag(p)]

    best = max(err.errors(), key=lambda e: (len(path(e)), not e["type"].endswith("_type")))
    where = ".".join(str(p) for p in path(best)) or None
    message = best["msg"]
    if best["type"] in _BOUNDS:  # pydantic writes an integer bound beyond 2**53 as a float
        words, key = _BOUNDS[best["type"]]
        message = f"Input should be {words} {best['ctx'][key]}"
    if best["type"] not in ("missing", "extra_forbidden", "too_long", "too_short"):  # these say it already
        message += f", got {_shown(best['input'])}"
    return APIError(f"{where}: {message}" if where else message, param=where)


_BOUNDS = {
    "less_than_equal": ("less than or equal to", "le"),
    "greater_than_equal": ("greater than or equal to", "ge"),
}


def _shown(value: Any) -> str:
    """A value as the client wrote it, cut short: what an error message quotes."""
    if isinstance(value, list | dict) and len(value) > 8:
        return f"a {'list' if isinstance(value, list) else 'object'} of {len(value)} items"
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _whole_number(value: Any) -> Any:
    """JSON has one kind of number: 5.0 is the integer 5 (to JSON Schema and to vLLM); 5.5 stays an error."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_whole_number)]


class _Schema(BaseModel):
    """A null field is an unset one: clients send unset optional fields as null (OpenAI marks most of them
    nullable), so a field that cannot hold null takes its default."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        defaulted = _defaulted_fields(cls)
        return {k: v for k, v in data.items() if v is not None or k not in defaulted}


@functools.cache
def _defaulted_fields(schema: type[BaseModel]) -> frozenset[str]:
    """The fields of ``schema`` (their names in a body) that have a default and cannot hold null."""
    return frozenset(
        field.alias or name
        for name, field in schema.model_fields.items()
        if not field.is_required() and type(None) not in get_args(field.annotation)
    )


class _Strict(_Schema):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _Lenient(_Schema):
    """Strict about the fields it declares; others are ignored (and logged: `ignored_fields`)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


def _extra_fields(model: BaseModel, where: str = "") -> list[str]:
    """The undeclared fields of `model` and of the objects nested in it, as paths (`stream_options.x`)."""
    names = [where + name for name in model.model_extra or {}]
    for name in model.model_fields_set:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            names += _extra_fields(value, f"{where}{model.model_fields[name].alias or name}.")
    return names


# Fields vLLM or OpenAI define that would change the output and are not implemented here, with their
# neutral values: any other value is a 400 naming the field.
UNSUPPORTED: dict[str, Any] = {
    "use_beam_search": False, "length_penalty": 1.0,
    "truncate_prompt_tokens": None, "allowed_token_ids": None, "bad_words": None,
    "logits_processors": None, "return_tokens_as_token_ids": False, "chat_template": None,
    "continue_final_message": False, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
    "suffix": None, "prediction": None, "audio": None, "echo": False,
}  # fmt: skip


class _Body(_Lenient):
    """A request body: strict about the fields it declares, tolerant of the others (see the module doc)."""

    def ignored_fields(self) -> list[str]:
        """The unknown fields (nested ones too), after refusing a non-neutral value of an UNSUPPORTED one."""
        extra = self.model_extra or {}
        for name, neutral in UNSUPPORTED.items():
            if name in extra and extra[name] is not None and extra[name] != neutral:
                raise APIError(f"{name} is not supported by this server", param=name)
        return sorted(name for name in _extra_fields(self) if name not in UNSUPPORTED)


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk has the usage so far


class JSONSchemaFormat(_Lenient):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class ChatTemplateKwargs(_Lenient):
    """vLLM's free-form chat template arguments: the ones the encoding takes; others are ignored."""

    thinking: bool | None = None
    reasoning_effort: str | Int | None = None  # vLLM's DeepSeek-V4 form of the top-level field
    drop_thinking: bool = True  # leave earlier turns' reasoning out of the prompt, as the official encoder


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: a JSON schema (other kinds are not implemented)."""

    json_: dict[str, Any] = Field(alias="json")


Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]
# One string is a list of one: a single type, so its errors name the field.
Stop = Annotated[
    Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None,
    BeforeValidator(lambda v: [v] if isinstance(v, str) else v),
]
Seed = Annotated[Int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])]
TopLogprobs = Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)]


class Sampling(_Body):
    """Fields both endpoints share."""

    model: str | None = None
    n: Annotated[Int, Field(ge=1, le=16)] = 1
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(ge=FLOAT32_TINY, le=1.0)] = 1.0
    top_k: Annotated[Int, Field(ge=-1, le=2**31 - 1)] = 0  # 0 or -1: off
    min_p: Probability = 0.0
    seed: Seed | None = None
    stop: Stop = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Field(ge=FLOAT32_TINY, le=10.0)] = 1.0
    logit_bias: (
        Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]], Field(max_length=MAX_LOGIT_BIAS)]
        | None
    ) = None
    ignore_eos: bool = False
    min_tokens: Annotated[Int, Field(ge=0)] = 0
    stop_token_ids: list[Annotated[Int, Field(ge=0)]] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for abuse tracking: accepted, not used
    prompt_logprobs: TopLogprobs | None = None  # vLLM's: each prompt token's logprob and this many top ones

    def stream_usage(self) -> tuple[bool, bool]:
        """(a last chunk with the usage, the usage so far in every chunk): what `stream_options` asks."""
        options = self.stream_options or StreamOptions()
        return options.include_usage, options.include_usage and options.continuous_usage_stats

    def check(self) -> None:
        """What the field types alone do not say."""
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true", param="stream_options")
        if self.stream and self.prompt_logprobs:  # vLLM's limit: a stream carries no prompt_logprobs field
            raise APIError("prompt_logprobs is not available when stream is true", param="prompt_logprobs")
        if self.seed is not None and self.seed + self.n - 1 > SEED_RANGE[1]:
            # Choice i draws from seed + i.
            raise APIError(f"seed={self.seed} must be at most {SEED_RANGE[1] - self.n + 1} for n={self.n}",
                           param="seed")  # fmt: skip

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        index: int,
        defaults: dict[str, float] | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The engine's parameters of choice `index`; `defaults` (the checkpoint's generation config)
        stand in for the fields of GENERATION_FIELDS the request left unset."""
        given = {f: getattr(self, f) for f in GENERATION_FIELDS}
        given.update({f: v for f, v in (defaults or {}).items() if f not in self.model_fields_set})
        stops = tuple(self.stop or ())
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=given["temperature"],
                top_k=max(int(given["top_k"]), 0),
                top_p=given["top_p"],
                min_p=given["min_p"],
                # Choice i of a seeded request draws from seed + i: the choices differ yet reproduce.
                seed=None if self.seed is None else self.seed + index,
                repetition_penalty=given["repetition_penalty"],
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                stop=stops,
                stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
            )
        except ValueError as err:  # its message starts with the field: "min_tokens=3 must be ..."
            field = str(err).split("=", 1)[0]
            raise APIError(str(err), param=field if field in self.model_fields else None) from None

    def token_bias(self, vocab_size: int) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            # ASCII only: int() also reads other scripts' digits ("٣" is 3) and "²" breaks it.
            if not (key.isascii() and key.isdigit() and len(key) <= 10) or int(key) >= vocab_size:
                raise APIError(
                    f"logit_bias: {key!r} is not a token id in [0, {vocab_size})", param="logit_bias"
                )
            bias[int(key)] = value
        return bias


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Annotated[Int, Field(ge=0)] | None = 16  # 0: with echo, the prompt scored alone
    logprobs: TopLogprobs | None = None
    echo: bool = False
    best_of: Int | None = None

    def check(self) -> None:
        super().check()
        if self.max_tokens == 0 and not self.echo:
            raise APIError("max_tokens=0 needs echo (the prompt and its logprobs, nothing generated)",
                           param="max_tokens")  # fmt: skip

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) returned, nothing generated."""
        return self.echo and self.max_tokens == 0

    def prompt_logprobs_count(self) -> int | None:
        """The prompt logprobs to compute: as asked, else with echo those the echoed tokens show (vLLM's)."""
        return self.prompt_logprobs if self.prompt_logprobs is not None or not self.echo else self.logprobs

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        prompts: list[str | list[int]] = (
            [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)  # type: ignore[arg-type]
        )
        if not prompts or any(len(x) == 0 for x in prompts):
            raise APIError("prompt must not be empty", param="prompt")
        if len(prompts) * self.n > MAX_SEQUENCES_PER_REQUEST:
            raise APIError(
                f"{len(prompts)} prompts x n={self.n} sequences: at most {MAX_SEQUENCES_PER_REQUEST}",
                param="prompt",
            )
        if self.best_of is not None and self.best_of != self.n:
            raise APIError("best_of must equal n (no server-side ranking)", param="best_of")
        return prompts


class _ChatTemplate(_Body):
    """What the chat encoding takes besides the messages."""

    tools: list[Any] | None = None  # checked by the chat encoding, as the messages
    # OpenAI's names or the encoding's own (docs/serving.md): a string, as OpenAI and vLLM type it (V4.1's
    # integer budgets go in chat_template_kwargs)
    reasoning_effort: str | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    add_generation_prompt: bool = True

    @property
    def effort(self) -> str | int | None:
        """`reasoning_effort`, or vLLM's `chat_template_kwargs.reasoning_effort`."""
        kwargs = self.chat_template_kwargs
        if self.reasoning_effort is None and kwargs is not None:
            return kwargs.reasoning_effort
        return self.reasoning_effort

    @property
    def thinking(self) -> bool:
        kwargs = self.chat_template_kwargs
        if kwargs is not None and kwargs.thinking is not None:
            return kwargs.thinking
        return self.effort not in (None, "none")


class ChatCompletionRequest(Sampling, _ChatTemplate):
    messages: list[Any]  # checked field by field by the chat encoding (model/chat.py)
    max_tokens: Annotated[Int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[Int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    thinking_budget: Annotated[Int, Field(ge=0)] | None = None  # reasoning tokens before </think> is forced
    max_reasoning_tokens: Annotated[Int, Field(ge=0)] | None = None  # another client's name for it
    guided_json: dict[str, Any] | None = None  # vLLM's older name of structured_outputs.json
    structured_outputs: StructuredOutputs | None = None

    def logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def reasoning_budget(self) -> int | None:
        """`thinking_budget` or `max_reasoning_tokens` (both only with thinking on)."""
        given = {v for v in (self.thinking_budget, self.max_reasoning_tokens) if v is not None}
        if len(given) > 1:
            raise APIError("thinking_budget and max_reasoning_tokens disagree", param="thinking_budget")
        if given and not self.thinking:
            raise APIError("thinking_budget needs thinking on", param="thinking_budget")
        return next(iter(given), None)

    def requested_max_tokens(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            if self.max_tokens != self.max_completion_tokens:
                raise APIError("max_tokens and max_completion_tokens disagree", param="max_completion_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def tool_mode(self) -> tuple[str, str | None]:
        """("none" | "auto" | "required" | "named", the named function)."""
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none"):
                raise APIError("tool_choice needs tools", param="tool_choice")
            return "none", None
        if isinstance(choice, NamedToolChoice):
            return "named", choice.function.name
        return choice or "auto", None

    def json_schema(self) -> dict[str, Any] | None:
        """The schema the output must follow, if any (`response_format`, or vLLM's two other fields)."""
        vllm = [s for s in (self.guided_json, self.structured_outputs and self.structured_outputs.json_) if s]
        if vllm:
            if self.response_format is not None or len(vllm) > 1:
                raise APIError("give one of response_format, guided_json and structured_outputs",
                               param="structured_outputs")  # fmt: skip
            return vllm[0]
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            if fmt is not None and fmt.json_schema is not None:
                raise APIError("json_schema is only allowed with type json_schema", param="response_format")
            return None
        if fmt.type == "json_object":
            if fmt.json_schema is not None:
                raise APIError("json_schema is only allowed with type json_schema", param="response_format")
            return {"type": "object"}
        if fmt.json_schema is None:
            raise APIError("response_format.json_schema is required", param="response_format.json_schema")
        return fmt.json_schema.schema_


class TokenizeRequest(_ChatTemplate):
    """vLLM's /tokenize: a text prompt, or chat messages rendered with the chat encoding."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool = True  # a text prompt gets BOS, as /v1/completions does
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Int]


class ResponsesReasoning(_Lenient):
    effort: str | None = None


class ResponsesRequest(_Body):
    """OpenAI's `POST /v1/responses`, for text in and out: `input` as text or messages, `instructions` as
    the system message; tools and structured text formats are not implemented (a 400 naming them)."""

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: Annotated[Int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(ge=FLOAT32_TINY, le=1.0)] = 1.0
    reasoning: ResponsesReasoning | None = None
    stream: bool = False
    tools: list[Any] | None = None
    text: dict[str, Any] | None = None

    def chat_request(self) -> ChatCompletionRequest:
        """The same request as chat: what the engine runs."""
        if self.tools:
            raise APIError("tools are not supported here: use /v1/chat/completions", param="tools")
        text_format = (self.text or {}).get("format") or {"type": "text"}
        if not isinstance(text_format, dict) or text_format.get("type") != "text":
            raise APIError("text.format: only text is supported", param="text.format")
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        for k, item in enumerate(items):
            if not isinstance(item, dict) or item.get("type", "message") != "message" or "role" not in item:
                where = f"input.{k}"
                raise APIError(f"{where}: only messages (role and content) are supported", param=where)
            messages.append({"role": item["role"], "content": _input_text(item.get("content"), f"input.{k}")})
        chat: dict[str, Any] = {"model": self.model, "messages": messages, "temperature": self.temperature,
                                "top_p": self.top_p, "max_tokens": self.max_output_tokens}  # fmt: skip
        if self.reasoning is not None and self.reasoning.effort is not None:
            chat["reasoning_effort"] = self.reasoning.effort
        try:
            return ChatCompletionRequest.model_validate(chat)
        except ValidationError as err:
            raise validation_error(err) from None


def _input_text(content: Any, where: str) -> str:
    """A Responses message's content: text, or a list of input_text / output_text parts."""
    if isinstance(content, str):
        return content

    def is_text(part: Any) -> bool:
        return (
            isinstance(part, dict)
            and part.get("type") in ("input_text", "output_text")
            and isinstance(part.get("text"), str)
        )

    if isinstance(content, list) and all(is_text(p) for p in content):
        return "".join(p["text"] for p in content)
    raise APIError(f"{where}.content: text or input_text parts only", param=f"{where}.content")
