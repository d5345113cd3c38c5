"""`/v1/responses` through the OpenAI SDK: text in and out, streamed events that add up to the reply."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import MODEL, Served


def test_a_response_is_the_chat_reply_in_the_responses_shape(server: Served):
    client = server.client()
    reply = client.responses.create(
        model=MODEL, input="Hello there", instructions="Be brief.", max_output_tokens=6, temperature=0
    )
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=6, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
    )  # fmt: skip
    assert reply.output_text == chat.choices[0].message.content
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.output_tokens == 6 and reply.usage.input_tokens == chat.usage.prompt_tokens
    assert [item.type for item in reply.output] == ["message"]


def test_streamed_events_add_up_to_the_reply(server: Served):
    client = server.client()
    message = {"role": "user", "content": [{"type": "input_text", "text": "Think, then answer"}]}
    fields = {"model": MODEL, "max_output_tokens": 8, "temperature": 0, "reasoning": {"effort": "high"},
              "input": [message]}  # fmt: skip
    whole = client.responses.create(**fields)
    events = list(client.responses.create(**fields, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in (
        "response.completed", "response.incomplete"
    )  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    kinds_of_items = [item.type for item in whole.output]
    assert kinds_of_items == (["reasoning", "message"] if reasoning else ["message"])


@pytest.mark.parametrize(
    "fields",
    [
        {"tools": [{"type": "function", "name": "f", "parameters": {}}]},
        {"text": {"format": {"type": "json_object"}}},
        {"input": [{"type": "function_call_output", "call_id": "x", "output": "1"}]},
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        {"max_output_tokens": 0},
    ],
    ids=["tools", "json format", "tool output item", "image part", "no tokens"],
)
def test_what_responses_does_not_support_is_a_400(server: Served, fields: dict):
    with pytest.raises(openai.BadRequestError):
        server.client().responses.create(**{"model": MODEL, "input": "Hi", **fields})
