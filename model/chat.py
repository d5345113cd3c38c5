"""DeepSeek V4 / V4.1 chat encoding (model-spec §11, §11.2): OpenAI-style messages to prompt text, strictly.

One renderer for every release; a ChatProfile (model/chat_profile.py) holds what differs. The layout is
that of the official encoders, quirks included, so prompts look like what the models were trained on:
consecutive user and tool messages merge into one user turn, and in thinking mode with dropping, developer
messages before the last user turn are left out like the reasoning of earlier assistant turns. Every
defect in a request raises ChatFormatError naming the offending field (the server answers 400); nothing is
silently repaired or ignored. A lenient caller (the server, as vLLM) first passes the messages through
`known_fields`, which drops the fields the encoding has no place for and names them.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from model.chat_profile import RESERVED_FRAGMENTS, SYSTEM, TASKS, V4_0731, ChatProfile, EffortError
from model.tokenizer import (
    ASSISTANT,
    BOS,
    DSML,
    EOS,
    LATEST_REMINDER,
    THINK_END,
    THINK_START,
    TOOL_RESULT_END,
    TOOL_RESULT_START,
    USER,
)

# §11.1, the same in every release.
RESPONSE_FORMAT_TEMPLATE = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"
)
NAME_RE = re.compile(r'[^"<>\r\n]+')  # tool and parameter names sit inside name="..." attributes

IMAGE_PARTS = ("image_url", "image", "input_image")
# Every role may carry OpenAI's participant `name`: checked, not rendered (the encoding has no place for it).
# An assistant message's reasoning comes under either name a reply of this server gives it.
_ALLOWED_FIELDS = {
    "system": {"role", "content", "name"},
    "developer": {"role", "content", "name"},
    "user": {"role", "content", "task", "name"},
    "latest_reminder": {"role", "content", "name"},
    "assistant": {"role", "content", "reasoning_content", "reasoning", "tool_calls", "name"},
    "tool": {"role", "content", "tool_call_id", "name"},
}

# Content part types that carry text (OpenAI's chat, its Responses API, an assistant's refusal), with the
# key that holds it: each is read as a text part, as vLLM reads them.
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
_CALL_FIELDS, _FUNCTION_FIELDS = {"id", "type", "function"}, {"name", "arguments"}


class ChatFormatError(ValueError):
    """A request the encoding cannot represent; `where` is a field path such as messages[2].content."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}")
        self.where = where
        self.problem = problem


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key!r}")
        obj[key] = value
    return obj


def _finite_float(text: str) -> float:
    # 1e400 parses to inf, which json.dumps would write back as the non-JSON token Infinity.
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of range")
    return value


def _integer(text: str) -> int | float:
    """An integer; one too long for int() (Python refuses over 4300 digits) as an infinite float, so that
    the caller that locates out-of-range numbers names its field."""
    if len(text) <= sys.get_int_max_str_digits():
        return int(text)
    return -math.inf if text.startswith("-") else math.inf


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def loads_strict(text: str, finite: bool = True) -> Any:
    """json.loads without NaN/Infinity, duplicate object keys or (unless `finite` is False, for a caller
    that locates them itself) out-of-range numbers such as 1e400; raises ValueError."""
    return json.loads(
        text,
        object_pairs_hook=_no_duplicate_keys,
        parse_constant=_reject_constant,
        parse_float=_finite_float if finite else float,
        parse_int=int if finite else _integer,
    )


def dumps(value: Any) -> str:
    """JSON as the official encoder writes it: default separators, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def _check_reserved(text: str, where: str) -> str:
    """`text` if the prompt may hold it: valid Unicode (JSON inside a tool call's arguments can still carry a
    lone surrogate such as "\\ud800") without the encoding's reserved strings."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ChatFormatError(where, "is not valid Unicode (a lone surrogate)") from None
    for fragment in RESERVED_FRAGMENTS:
        if fragment in text:
            raise ChatFormatError(where, f"contains the reserved string {fragment!r}")
    return text


def _check_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ChatFormatError(where, 'must be a non-empty string without ", <, > or line breaks')
    return _check_reserved(name, where)


def _json_section(value: Any, where: str) -> str:
    try:
        text = dumps(value)
    except (TypeError, ValueError) as err:  # NaN, cycles, non-JSON types from a lenient API decoder
        raise ChatFormatError(where, f"is not serializable as strict JSON ({err})") from None
    return _check_reserved(text, where)


def known_fields(messages: Any) -> tuple[Any, list[str]]:
    """`messages` without the fields the encoding has no place for (OpenAI's `refusal` and `annotations`, a
    client's `cache_control`, the `index` of a streamed tool call), its text parts of every kind as text
    parts, and the names of what was dropped (`messages[].cache_control`). A null field is an unset one and
    is dropped unnamed. Anything that is not of the expected shape is kept, for encode_messages to refuse."""
    ignored: set[str] = set()

    def keep(obj: Any, allowed: set[str], where: str) -> Any:
        if not isinstance(obj, dict):
            return obj
        ignored.update(
            f"{where}.{key}" for key, value in obj.items() if key not in allowed and value is not None
        )
        return {key: value for key, value in obj.items() if key in allowed and value is not None}

    def part(block: Any) -> Any:
        kind = block.get("type") if isinstance(block, dict) else None
        key = TEXT_PARTS.get(kind) if isinstance(kind, str) else None  # a list or an object is no type
        if key is None or key not in block:
            return block
        ignored.update(f"messages[].content[].{k}" for k in block if k not in ("type", key))
        return {"type": "text", "text": block[key]}

    def call(item: Any) -> Any:
        item = keep(item, _CALL_FIELDS, "messages[].tool_calls[]")
        if isinstance(item, dict) and "function" in item:
            item["function"] = keep(item["function"], _FUNCTION_FIELDS, "messages[].tool_calls[].function")
        return item

    if not isinstance(messages, list):
        return messages, []
    kept = []
    for msg in messages:
        role = msg.get("role") if isinstance(msg, dict) else None
        if not isinstance(role, str) or role not in _ALLOWED_FIELDS:
            kept.append(msg)
            continue
        msg = keep(msg, _ALLOWED_FIELDS[role], "messages[]")
        if isinstance(msg.get("content"), list):
            msg["content"] = [part(block) for block in msg["content"]]
        if isinstance(msg.get("tool_calls"), list):
            msg["tool_calls"] = [call(item) for item in msg["tool_calls"]]
        kept.append(msg)
    return kept, sorted(ignored)


def _text(content: Any, where: str) -> str:
    """A string, or text blocks joined by blank lines as the official encoder joins them."""
    if isinstance(content, str):
        return _check_reserved(content, where)
    if not isinstance(content, list) or not content:  # an empty list would still add a blank user part
        raise ChatFormatError(where, "must be a string or a non-empty list of text blocks")
    texts = []
    for j, block in enumerate(content):
        if isinstance(block, dict) and block.get("type") in IMAGE_PARTS:
            raise ChatFormatError(f"{where}[{j}]", "images are not supported: this server serves text only")
        if not isinstance(block, dict) or block.get("type") != "text" or set(block) != {"type", "text"}:
            raise ChatFormatError(f"{where}[{j}]", 'must be {"type": "text", "text": ...}')
        if not isinstance(block["text"], str):
            raise ChatFormatError(f"{where}[{j}].text", "must be a string")
        texts.append(_check_reserved(block["text"], f"{where}[{j}].text"))
    return "\n\n".join(texts)


def _render_arguments(arguments: Any, where: str, parameter: str) -> str:
    if not isinstance(arguments, str):
        raise ChatFormatError(where, "must be a JSON string")
    try:
        args = loads_strict(arguments)
    except ValueError as err:
        raise ChatFormatError(where, f"is not strict JSON ({err})") from None
    if not isinstance(args, dict):
        raise ChatFormatError(where, "must encode a JSON object")
    params = []
    for key, value in args.items():
        flag, text = ("true", value) if isinstance(value, str) else ("false", dumps(value))
        try:
            _check_name(key, where)
            _check_reserved(text, where)
        except ChatFormatError as err:
            raise ChatFormatError(where, f"parameter {key!r}: {err.problem}") from None
        params.append(f'<{DSML}{parameter} name="{key}" string="{flag}">{text}</{DSML}{parameter}>')
    return "\n".join(params)


def _render_tool_calls(calls: Any, where: str, p: ChatProfile) -> tuple[str, list[str | None]]:
    """The DSML block appended to assistant content, and the call ids in call order."""
    if calls is None:
        return "", []
    if not isinstance(calls, list):
        raise ChatFormatError(where, "must be a list")
    invokes: list[str] = []
    ids: list[str | None] = []
    for k, call in enumerate(calls):
        at = f"{where}[{k}]"
        if not isinstance(call, dict) or not set(call) <= {"id", "type", "function"}:
            raise ChatFormatError(at, "must be an object with only id, type and function")
        if call.get("type", "function") != "function":
            raise ChatFormatError(f"{at}.type", 'must be "function"')
        call_id = call.get("id")
        if call_id is not None and (not isinstance(call_id, str) or not call_id):
            raise ChatFormatError(f"{at}.id", "must be a non-empty string")
        if call_id is not None and call_id in ids:
            raise ChatFormatError(f"{at}.id", f"duplicate tool call id {call_id!r}")
        ids.append(call_id)
        fn = call.get("function")
        if not isinstance(fn, dict) or set(fn) != {"name", "arguments"}:
            raise ChatFormatError(f"{at}.function", "must be an object with exactly name and arguments")
        name = _check_name(fn["name"], f"{at}.function.name")
        args = _render_arguments(fn["arguments"], f"{at}.function.arguments", p.parameter_tag)
        invokes.append(f'<{DSML}{p.invoke_tag} name="{name}">\n{args}\n</{DSML}{p.invoke_tag}>')
    if not invokes:
        return "", ids
    return f"{p.tool_calls_prefix}>\n" + "\n".join(invokes) + f"\n</{DSML}{p.calls_tag}>", ids


@dataclass
class _Turn:
    """One rendered unit after merging; a user turn keeps (call index, or -1 for text, text) parts.

    `role` is a message role, or mid_system: a V4.1 system message after the first, a turn of its own.
    """

    role: str
    text: str = ""
    task: str | None = None
    reasoning: str = ""
    calls: str = ""
    parts: list[tuple[int, str]] = field(default_factory=list)


def _tools_section(tools: Any, profile: ChatProfile) -> str:
    if not isinstance(tools, list):
        raise ChatFormatError("tools", "must be a list")
    schemas: list[str] = []
    names: set[str] = set()
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict) or set(tool) != {"type", "function"} or tool["type"] != "function":
            raise ChatFormatError(f"tools[{k}]", 'must be {"type": "function", "function": {...}}')
        if not isinstance(tool["function"], dict):
            raise ChatFormatError(f"tools[{k}].function", "must be an object")
        name = _check_name(tool["function"].get("name"), f"tools[{k}].function.name")
        if name in names:
            raise ChatFormatError(f"tools[{k}].function.name", f"duplicate tool name {name!r}")
        names.add(name)
        for key, kind, what in (
            ("description", str, "a string"),
            ("parameters", dict, "a JSON schema object"),
        ):
            if tool["function"].get(key) is not None and not isinstance(tool["function"][key], kind):
                raise ChatFormatError(f"tools[{k}].function.{key}", f"must be {what}")
        schemas.append(_json_section(tool["function"], f"tools[{k}].function"))
    return profile.tools_section("\n".join(schemas))


def check_tools(tools: Any, profile: ChatProfile) -> None:
    """Raise ChatFormatError for tools the encoding could not render (also when they are not shown)."""
    _tools_section(tools, profile)


def _turns(messages: Any, profile: ChatProfile) -> list[_Turn]:
    """Validate the messages and merge them into turns, tool results resolved to call indices."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages", "must be a non-empty list")
    turns: list[_Turn] = []
    call_ids: list[str | None] | None = None  # of the latest assistant message; None: it made no calls
    answered: set[int] = set()
    for i, msg in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ChatFormatError(at, "must be an object")
        role = msg.get("role")
        if not isinstance(role, str) or role not in _ALLOWED_FIELDS:
            raise ChatFormatError(f"{at}.role", f"must be one of {sorted(_ALLOWED_FIELDS)}")
        unknown = set(msg) - _ALLOWED_FIELDS[role]
        if unknown:
            raise ChatFormatError(f"{at}.{sorted(unknown)[0]}", f"is not a field of {role} messages")
        if "name" in msg and not isinstance(msg["name"], str):
            raise ChatFormatError(f"{at}.name", "must be a string")
        content = msg.get("content")
        if role == "assistant":
            turn = _Turn(role, "" if content is None else _text(content, f"{at}.content"))
            turn.reasoning = _reasoning(msg, at)
            turn.calls, ids = _render_tool_calls(msg.get("tool_calls"), f"{at}.tool_calls", profile)
            call_ids, answered = (ids or None), set()
            turns.append(turn)
            continue
        if content is None:
            raise ChatFormatError(f"{at}.content", "is required")
        text = _text(content, f"{at}.content")
        if role == "developer" and not text:
            raise ChatFormatError(f"{at}.content", "must not be empty")
        if role == "system" and profile.v41 and i > 0:
            role = "mid_system"
        if role not in ("user", "tool"):
            turns.append(_Turn(role, text))
            continue
        index = -1
        if role == "tool":
            index = _resolve_result(msg.get("tool_call_id"), call_ids, answered, at)
            text = f"{TOOL_RESULT_START}{text}{TOOL_RESULT_END}"
        task = msg.get("task")
        if task is not None and (not isinstance(task, str) or task not in TASKS):
            raise ChatFormatError(f"{at}.task", f"must be one of {sorted(TASKS)}")
        # A task message is a turn of its own: the model answers it, not the turns around it.
        if task is not None or not turns or turns[-1].role != "user" or turns[-1].task is not None:
            turns.append(_Turn("user", task=task))
        turns[-1].parts.append((index, text))
    return turns


def _reasoning(msg: dict[str, Any], at: str) -> str:
    """An assistant message's reasoning, under `reasoning_content` or `reasoning` (the same text if both)."""
    given = {key: msg[key] for key in ("reasoning_content", "reasoning") if msg.get(key) is not None}
    for key, value in given.items():
        if not isinstance(value, str):
            raise ChatFormatError(f"{at}.{key}", "must be a string")
    if len(set(given.values())) > 1:
        raise ChatFormatError(f"{at}.reasoning", "differs from reasoning_content")
    key, text = next(iter(given.items()), ("reasoning_content", ""))
    return _check_reserved(text, f"{at}.{key}")


def _resolve_result(call_id: Any, call_ids: list[str | None] | None, answered: set[int], at: str) -> int:
    """Index of the call a tool message answers, in the latest assistant message's calls."""
    if call_ids is None:
        raise ChatFormatError(at, "tool message without a preceding assistant message with tool_calls")
    if call_id is None:
        if len(call_ids) > 1:
            raise ChatFormatError(f"{at}.tool_call_id", "is required when the assistant made several calls")
        index = 0
    elif not isinstance(call_id, str) or call_id not in call_ids:
        raise ChatFormatError(f"{at}.tool_call_id", f"{call_id!r} matches no call of the preceding assistant")
    else:
        index = call_ids.index(call_id)
    if index in answered:
        raise ChatFormatError(f"{at}.tool_call_id", f"duplicate result for call {call_ids[index] or index!r}")
    answered.add(index)
    return index


_USER_TURNS = ("user", "developer", "mid_system")  # the turns the model answers


def _last_user(turns: list[_Turn]) -> int:
    return max((i for i, t in enumerate(turns) if t.role in _USER_TURNS), default=-1)


def _user_turn_text(turn: _Turn) -> str:
    # Results take the order of the calls; text blocks keep their places.
    results = iter(sorted(p for p in turn.parts if p[0] >= 0))
    return USER + "\n\n".join(text if index < 0 else next(results)[1] for index, text in turn.parts)


def encode_messages(
    messages: list[dict[str, Any]],
    *,
    profile: ChatProfile = V4_0731,
    tools: list[dict[str, Any]] | None = None,
    thinking: bool = False,
    reasoning_effort: str | int | None = None,
    response_format: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
    drop_thinking: bool = True,
) -> str:
    """The prompt text for an OpenAI-style conversation in `profile`'s encoding (model-spec §11, §11.2).

    `tools` are OpenAI tool objects; `response_format` is the JSON object shown to the model as the
    schema. Both go to the first system message (V4.1: the system message that opens the conversation),
    an empty one put first when there is none, where the official encoders expect them.
    `reasoning_effort` is one of the profile's levels (default: the profile's); it only changes
    thinking-mode prompts but is checked in chat mode too. Raises ChatFormatError on any defect.
    """
    try:
        effort = profile.effort_prefix(reasoning_effort)
    except EffortError as err:
        raise ChatFormatError("reasoning_effort", str(err)) from None
    effort = effort if thinking else ""
    turns = _turns(messages, profile)
    sections = []
    if tools:
        sections.append(_tools_section(tools, profile))
    elif tools is not None and not isinstance(tools, list):
        raise ChatFormatError("tools", "must be a list")
    if response_format is not None:
        if not isinstance(response_format, dict):
            raise ChatFormatError("response_format", "must be an object")
        schema = _json_section(response_format, "response_format")
        sections.append(RESPONSE_FORMAT_TEMPLATE.format(schema=schema))
    if sections:
        host = next((t for t in turns if t.role == "system"), None)
        if host is None:
            host = _Turn("system")
            turns.insert(0, host)
        host.text += "".join("\n\n" + s for s in sections)

    drop = drop_thinking and not tools  # the official encoders keep all reasoning when tools are present
    if thinking and drop:
        last = _last_user(turns)
        turns = [t for i, t in enumerate(turns) if t.role != "developer" or i >= last]
    last = _last_user(turns)

    out = [BOS]
    if profile.v41 and (effort or (turns and turns[0].role == "system")):
        out.append(SYSTEM)
    out.append(effort)
    for i, turn in enumerate(turns):
        if turn.role == "system":
            out.append(turn.text)
        elif turn.role == "mid_system":
            out.append(SYSTEM + turn.text)
        elif turn.role == "developer":
            out.append(USER + turn.text)
        elif turn.role == "latest_reminder":
            out.append(LATEST_REMINDER + turn.text)
        elif turn.role == "user":
            out.append(_user_turn_text(turn))
        else:
            after_task = i > 0 and turns[i - 1].task is not None  # a task's answer has no reasoning part
            if thinking and not after_task and (not drop or i > last):
                out.append(turn.reasoning + THINK_END)
            out.append(turn.text + turn.calls + EOS)
        if turn.role not in _USER_TURNS:
            continue
        think = THINK_START if thinking and (not drop or i >= last) else THINK_END
        following = turns[i + 1].role if i + 1 < len(turns) else None
        if turn.task is not None:
            out.append(ASSISTANT + (think if turn.task == "action" else "") + TASKS[turn.task])
        elif following in ("assistant", "latest_reminder") or (following is None and add_generation_prompt):
            out.append(ASSISTANT + think)
    return "".join(out)
