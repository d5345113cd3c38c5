"""The chat encoding profiles (model-spec §11.1-§11.3): what differs between V4, V4-0731 and V4.1.

One renderer (model/chat.py) and one parser (model/chat_parse.py) serve every release; a profile holds the
release's protocol strings and layout switches. `v4` is the first V4 release (V4-Flash, V4-Pro and their
-DSpark variants), `v4-0731` the V4-Flash-0731 / V4-Pro-0813 revision, `v41` the V4.1 encoding.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from model.tokenizer import DSML, SPECIAL_TOKENS, THINK_END, THINK_START, TOOL_RESULT_END, TOOL_RESULT_START

SYSTEM = "<｜System｜>"  # V4.1 only
IMAGE = "<｜deepseek_image｜>"  # V4.1's image placeholder; never literal text

# §11.1 protocol strings, byte for byte.
ABSOLUTE_MAXIMUM = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the "
    "root cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
    "adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)
BEYOND_MAXIMUM = (
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
    "decompose the problem into its most fundamental components, trace every causal chain to its root, "
    "and resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and "
    "are certain that no assumption remains unchecked and no error remains undiscovered.\n\n"
)
V41_EFFORT = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"<{dsml}{calls}>" block like the following:

<{dsml}{calls}>
<{dsml}{invoke} name="$TOOL_NAME">
<{dsml}{parameter} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}{parameter}>
...
</{dsml}{invoke}>
<{dsml}{invoke} name="$TOOL_NAME2">
...
</{dsml}{invoke}>
</{dsml}{calls}>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, \
booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think_start}), you MUST output your complete reasoning inside \
{think_start}...{think_end} BEFORE any tool calls or final response.

Otherwise, output directly after {think_end} with tool calls or final response.

### Available Tool Schemas

{tool_schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""
TASKS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}
# Text that would forge protocol structure if a user could smuggle it into a prompt; one set for every
# profile, so a conversation valid under one encoding is valid under all.
RESERVED_FRAGMENTS = tuple(
    sorted(SPECIAL_TOKENS | {THINK_START, THINK_END, DSML, TOOL_RESULT_START, TOOL_RESULT_END, SYSTEM, IMAGE})
)
# OpenAI's effort names that no profile has; each profile maps them onto its own values.
OPENAI_EFFORTS = ("minimal", "low", "medium", "high", "xhigh", "max")
NO_EFFORT = "none"  # OpenAI's "no reasoning": chat mode


class EffortError(ValueError):
    """A reasoning effort the profile does not accept; the message lists what it does."""


@dataclass(frozen=True, eq=False)  # one object per release, hashed by identity
class ChatProfile:
    """One release's chat encoding: protocol strings, effort levels and layout switches."""

    name: str
    calls_tag: str  # DSML element names: V4 "tool_calls" / "invoke" / "parameter", V4.1 with a leading space
    invoke_tag: str
    parameter_tag: str
    efforts: Mapping[str, str | int]  # accepted effort name -> prefix text (V4) or budget (V4.1)
    default_effort: str
    openai_efforts: Mapping[str, str]  # OpenAI effort name -> accepted effort name
    # V4.1: <｜System｜> opens the prompt and every later system message, which then counts as a user turn;
    # integer budgets; a tool-call block inside the reasoning is malformed.
    v41: bool = False

    def effort_prefix(self, effort: str | int | None) -> str:
        """The paragraph a thinking-mode prompt starts with; raises EffortError for an unknown effort."""
        effort = self.default_effort if effort is None else effort
        if self.v41 and isinstance(effort, int) and not isinstance(effort, bool) and 1 <= effort <= 100:
            return V41_EFFORT.format(effort)
        if isinstance(effort, str) and effort in self.efforts:
            value = self.efforts[effort]
            return V41_EFFORT.format(value) if self.v41 else str(value)
        raise EffortError(f"{effort!r} is not an effort of the {self.name} encoding ({self.accepted()})")

    def openai_effort(self, effort: str | int | None, thinking: bool = False) -> str | int | None:
        """An API `reasoning_effort` as this profile's own value (None: the default or chat mode)."""
        if effort == NO_EFFORT and thinking:
            raise EffortError("none turns thinking off, but thinking mode was asked for")
        if effort is None or effort == NO_EFFORT:
            return None
        if isinstance(effort, str) and effort in self.openai_efforts:
            return self.openai_efforts[effort]
        self.effort_prefix(effort)  # the profile's own values pass; anything else raises
        return effort

    def accepted(self) -> str:
        names = ", ".join(sorted(self.efforts))
        return f"{names} or an integer 1-100" if self.v41 else names

    def tools_section(self, tool_schemas: str) -> str:
        return TOOLS_TEMPLATE.format(
            dsml=DSML, calls=self.calls_tag, invoke=self.invoke_tag, parameter=self.parameter_tag,
            think_start=THINK_START, think_end=THINK_END, tool_schemas=tool_schemas,
        )  # fmt: skip

    @property
    def tool_calls_prefix(self) -> str:
        """How a completion announces its tool calls."""
        return f"\n\n<{DSML}{self.calls_tag}"


_V4_TAGS = {"calls_tag": "tool_calls", "invoke_tag": "invoke", "parameter_tag": "parameter"}
V4 = ChatProfile(
    "v4", **_V4_TAGS, efforts={"high": "", "max": ABSOLUTE_MAXIMUM}, default_effort="high",
    openai_efforts={"minimal": "high", "low": "high", "medium": "high", "xhigh": "max"},
)  # fmt: skip
V4_0731 = ChatProfile(
    "v4-0731", **_V4_TAGS, efforts={"low": "", "high": ABSOLUTE_MAXIMUM, "max": BEYOND_MAXIMUM},
    default_effort="low", openai_efforts={"minimal": "low", "medium": "low", "xhigh": "max"},
)  # fmt: skip
V41 = ChatProfile(
    "v41", calls_tag=" calls", invoke_tag=" invoke", parameter_tag=" parameter",
    efforts={"low": 50, "high": 75, "max": 100}, default_effort="high",
    openai_efforts={"minimal": "low", "medium": "high", "xhigh": "max"}, v41=True,
)  # fmt: skip
PROFILES = {p.name: p for p in (V4, V4_0731, V41)}


def select_chat_profile(
    model_type: str, checkpoint: str | Path | None = None, override: str | None = None
) -> ChatProfile:
    """The encoding a checkpoint was trained with (§11.3), or the profile named by `override`.

    V4.1 by its model type. The two V4 revisions differ only in the effort texts and share their configs,
    so the checkpoint's own `encoding/encoding_dsv4.py` decides: the 0731 one carries the "Beyond maximum"
    text. Without that file: 0731, as other servers do (`--chat-encoding` overrides).
    """
    if override is not None:
        if override not in PROFILES:
            raise ValueError(f"chat encoding {override!r} is not one of {list(PROFILES)}")
        return PROFILES[override]
    if model_type == "deepseek_v41":
        return V41
    if model_type != "deepseek_v4":
        raise ValueError(
            f"no chat encoding for model_type {model_type!r} (expected deepseek_v4 or deepseek_v41)"
        )
    encoder = Path(checkpoint) / "encoding" / "encoding_dsv4.py" if checkpoint is not None else None
    if encoder is not None and encoder.is_file():
        return V4_0731 if "Beyond maximum" in encoder.read_text(encoding="utf-8", errors="replace") else V4
    return V4_0731
