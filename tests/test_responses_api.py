"""POST /v1/responses through the real server with the openai SDK: the same tokens and
logprobs as chat, streamed events in OpenAI's order (and the SDK's own accumulator over
them), function tools and their outputs, previous_response_id, text.format, the 400s."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pydantic
import pytest
from test_tool_calls import TOOLS

LOGPROBS = ["message.output_text.logprobs"]
ASK = "What is the weather in Rome this week?"
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def _chat(client, model: str, **kwargs: object):
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": ASK}], **kwargs
    )


def test_text_and_logprobs_equal_chats(qwen2_server, qwen2_client) -> None:
    model = qwen2_server.model
    chat = _chat(qwen2_client, model, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    out = qwen2_client.responses.create(
        model=model,
        input=ASK,
        max_output_tokens=8,
        temperature=0,
        include=LOGPROBS,
        top_logprobs=3,
    )
    assert out.id.startswith("resp_") and out.object == "response"
    assert out.output_text == chat.choices[0].message.content
    (message,) = out.output
    assert message.type == "message" and message.role == "assistant"
    part = message.content[0]
    expected = [e.model_dump() for e in chat.choices[0].logprobs.content]
    assert [e.model_dump() for e in part.logprobs] == expected  # the same floats, bit for bit
    assert out.usage.input_tokens == chat.usage.prompt_tokens
    assert out.usage.output_tokens == chat.usage.completion_tokens
    assert out.status == (
        "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    )


def test_instructions_are_a_system_message(qwen2_server, qwen2_client) -> None:
    model = qwen2_server.model
    system = {"role": "system", "content": "Be brief."}
    chat = qwen2_client.chat.completions.create(
        model=model, messages=[system, {"role": "user", "content": ASK}], max_tokens=4
    )
    out = qwen2_client.responses.create(
        model=model, input=ASK, instructions="Be brief.", max_output_tokens=4
    )
    assert out.usage.input_tokens == chat.usage.prompt_tokens
    assert out.instructions == "Be brief."


def test_an_empty_tools_list_is_no_tools(qwen2_server, qwen2_client) -> None:
    """openai-agents sends `tools: []` (and tool_choice auto) to an agent without tools: the
    prompt and the answer are those of a request without them, on both routes."""
    model = qwen2_server.model
    plain = _chat(qwen2_client, model, max_tokens=6, temperature=0)
    empty = _chat(qwen2_client, model, max_tokens=6, temperature=0, tools=[], tool_choice="auto")
    assert empty.choices[0].message.content == plain.choices[0].message.content
    assert empty.usage.prompt_tokens == plain.usage.prompt_tokens
    out = qwen2_client.responses.create(
        model=model, input=ASK, max_output_tokens=6, temperature=0, tools=[], tool_choice="auto"
    )
    assert out.output_text == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="needs `tools`"):
        _chat(qwen2_client, model, max_tokens=6, tools=[], tool_choice="required")


def test_cut_short_is_incomplete(qwen2_server, qwen2_client) -> None:
    out = qwen2_client.responses.create(
        model=qwen2_server.model, input=ASK, max_output_tokens=1, temperature=0
    )
    if out.usage.output_tokens == 1 and out.output_text:
        assert out.status == "incomplete"
        assert out.incomplete_details.reason == "max_output_tokens"


def test_streamed_events_come_in_openais_order(qwen2_server, qwen2_client) -> None:
    kwargs = {
        "model": qwen2_server.model,
        "input": ASK,
        "max_output_tokens": 10,
        "temperature": 0,
        "include": LOGPROBS,
        "top_logprobs": 2,
    }
    whole = qwen2_client.responses.create(**kwargs)
    events = list(qwen2_client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{whole.status}",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == whole.output_text
    streamed_logprobs = [lp.model_dump() for e in deltas for lp in e.logprobs]
    assert streamed_logprobs == [lp.model_dump() for lp in whole.output[0].content[0].logprobs]
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage == whole.usage
    # the SDK's own accumulator checks the items' identities event by event
    with qwen2_client.responses.stream(**kwargs) as stream:
        last = [event.type for event in stream][-1]
        assert last == f"response.{whole.status}"
        if whole.status == "completed":  # NOTE: the SDK keeps no final response otherwise
            assert stream.get_final_response().output_text == whole.output_text


def test_function_calls_and_their_outputs(qwen2_server, qwen2_client) -> None:
    model = qwen2_server.model
    first = qwen2_client.responses.create(
        model=model,
        input=ASK,
        tools=FLAT_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and first.status == "completed"
    for call in calls:
        assert call.call_id.startswith("call_") and call.name in {"get_weather", "get_time"}
        json.loads(call.arguments)
    outputs = [
        {"type": "function_call_output", "call_id": c.call_id, "output": "sunny"} for c in calls
    ]
    chained = qwen2_client.responses.create(
        model=model,
        previous_response_id=first.id,
        input=outputs,
        tools=FLAT_TOOLS,
        max_output_tokens=4,
    )
    # the same conversation sent whole, items as the SDK returned them
    items = [{"role": "user", "content": ASK}, *[c.model_dump() for c in calls], *outputs]
    explicit = qwen2_client.responses.create(
        model=model, input=items, tools=FLAT_TOOLS, max_output_tokens=4
    )
    assert chained.previous_response_id == first.id
    assert chained.usage.input_tokens == explicit.usage.input_tokens > first.usage.input_tokens
    streamed = qwen2_client.responses.create(
        model=model,
        input=ASK,
        tools=FLAT_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        stream=True,
    )
    args: dict[str, str] = {}
    done = []
    for event in streamed:
        if event.type == "response.function_call_arguments.delta":
            args[event.item_id] = args.get(event.item_id, "") + event.delta
        elif event.type == "response.output_item.done" and event.item.type == "function_call":
            done.append(event.item)
    assert done and all(args[item.id] == item.arguments for item in done)


class City(pydantic.BaseModel):
    city: Literal["Paris", "Rome"]
    days: int = pydantic.Field(ge=1, le=7)


def test_text_format_json_schema_holds(qwen2_server, qwen2_client) -> None:
    out = qwen2_client.responses.parse(
        model=qwen2_server.model, input=ASK, text_format=City, max_output_tokens=60
    )
    assert out.status == "completed"
    assert isinstance(out.output_parsed, City)


def test_stored_responses(qwen2_server, qwen2_client) -> None:
    model = qwen2_server.model
    kept = qwen2_client.responses.create(model=model, input="Hi", max_output_tokens=3)
    got = qwen2_client.responses.retrieve(kept.id)
    assert got.id == kept.id and got.output_text == kept.output_text
    unkept = qwen2_client.responses.create(
        model=model, input="Hi", max_output_tokens=3, store=False
    )
    for missing in (unkept.id, "resp_nope"):
        with pytest.raises(openai.BadRequestError) as e:
            qwen2_client.responses.create(
                model=model, input="Hi", previous_response_id=missing, max_output_tokens=3
            )
        assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]
        assert e.value.body["code"] == "previous_response_not_found"  # type: ignore[index]
    qwen2_client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        qwen2_client.responses.retrieve(kept.id)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["nope"]}, "include[0]"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"max_tool_calls": 2}, "max_tool_calls"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": []}, "input"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "no"}}}},
            "text.format",
        ),
        (
            {"tool_choice": {"type": "function", "name": "nope"}, "tools": FLAT_TOOLS},
            "tool_choice.name",
        ),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)  # fmt: skip
def test_what_responses_cannot_serve_is_a_400(qwen2_server, fields: dict, param: str) -> None:
    body = {"model": qwen2_server.model, "input": "Hi", "max_output_tokens": 2, **fields}
    status, out = qwen2_server.post("/v1/responses", body)
    assert status == 400, out
    assert out["error"]["param"] == param, out


def test_ignored_fields_are_taken(qwen2_server, qwen2_client) -> None:
    out = qwen2_client.responses.create(
        model=qwen2_server.model,
        input="Hi",
        max_output_tokens=2,
        metadata={"a": "b"},
        user="u",
        safety_identifier="s",
        service_tier="auto",
        prompt_cache_key="k",
        reasoning={"effort": "low", "summary": "auto"},
        text={"verbosity": "low"},
        include=["reasoning.encrypted_content"],
        truncation="disabled",
    )
    assert out.status in ("completed", "incomplete") and out.metadata == {"a": "b"}
