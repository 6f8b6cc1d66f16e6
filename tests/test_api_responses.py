"""OpenAI's Responses API (``POST /v1/responses``) against a scripted admission actor, and at
the end Codex's request shape on the real stack.

No model here: ``ScriptedAdmission`` (tests/http_stack.py) plays the script the last message's
text names: the default "Hello world", "tool-call" (text, then two whole calls), "custom-call"
and "shell-call" (a call of a freeform tool, of local_shell), "reasoning" (reasoning, then
text), "length", "fail-mid-stream", "refuse-before-start". The official
``openai`` client is the judge of the shapes; every body and every event is also validated
against its pydantic models, which parsing alone does not do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import http_stack
import openai
import pytest
from agent_shapes import APPLY_PATCH_GRAMMAR
from aiohttp.test_utils import TestClient
from http_stack import (
    BUSY_MODEL,
    CUSTOM_CALL,
    MODEL,
    PATCH,
    REASONING,
    SHELL_CALL,
    TOOL_CALLS,
    TOOL_TEXT,
    Scripted,
    real_stack,
)
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from troupe.actors.messages import AdmitChat, OutputFormat, ToolChoice

RESPONSES = "/v1/responses"
HELLO = "Hello world"
REASONING_TEXT = "".join(REASONING)

# The scripted stack's fixtures, bound here by name so that pytest finds them.
scripted, client, openai_client = http_stack.scripted, http_stack.client, http_stack.openai_client

_stream_event = TypeAdapter(ResponseStreamEvent)

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": False,
}
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object"}}


def body(input: Any = "hello", **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": input, **fields}


def admitted(scripted: Scripted) -> AdmitChat:
    """The admission message of the last request."""
    msg = scripted.seen[-1]
    assert isinstance(msg, AdmitChat)
    return msg


def assert_error_shape(data: dict[str, Any], *, param: str | None) -> dict[str, Any]:
    assert set(data) == {"error"}
    error = data["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param
    return error


async def assert_still_serving(client: TestClient) -> None:
    resp = await client.post(RESPONSES, json=body())
    assert resp.status == 200
    assert Response.model_validate(await resp.json()).output_text == HELLO


async def whole(client: TestClient, **fields: Any) -> Response:
    """A non-streamed answer, validated against the SDK's ``Response`` model."""
    resp = await client.post(RESPONSES, json=body(**fields))
    assert resp.status == 200, await resp.text()
    return Response.model_validate(await resp.json())


async def events(client: TestClient, **fields: Any) -> list[dict[str, Any]]:
    """A streamed answer's events, each validated against the SDK's event models.

    Checks what every stream must hold: ``event:`` names the data's type, sequence numbers
    count from 0, and every item added is done before the stream ends (once, same index).
    """
    resp = await client.post(RESPONSES, json=body(stream=True, **fields))
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "text/event-stream"
    parsed = http_stack.parse_named_sse(await resp.text())
    data = [event for _, event in parsed]
    for i, event in enumerate(data):
        _stream_event.validate_python(event)
        assert event["sequence_number"] == i
    added = [e["output_index"] for e in data if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in data if e["type"] == "response.output_item.done"]
    assert added == list(range(len(added)))
    if data[-1]["type"] != "response.failed":
        assert done == added
    return data


def types(data: list[dict[str, Any]]) -> list[str]:
    return [event["type"] for event in data]


# --- the whole answer ----------------------------------------------------------------------


async def test_text_answer_has_the_response_shape_and_usage(
    client: TestClient, scripted: Scripted
) -> None:
    response = await whole(client)
    assert response.id.startswith("resp_") and response.id == admitted(scripted).request_id
    assert response.object == "response" and response.status == "completed"
    assert response.model == MODEL and response.error is None
    assert response.incomplete_details is None
    [message] = response.output
    assert message.type == "message" and message.id.startswith("msg_")
    assert (message.role, message.status) == ("assistant", "completed")
    [part] = message.content
    assert part.type == "output_text" and part.text == HELLO and part.annotations == []
    assert response.output_text == HELLO
    usage = response.usage
    assert usage is not None
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (5, 4, 9)
    assert usage.input_tokens_details.cached_tokens == 2
    assert usage.output_tokens_details.reasoning_tokens == 0


async def test_response_echoes_the_request(client: TestClient) -> None:
    fmt = {"type": "json_schema", "name": "answer", "schema": {"type": "object"}, "strict": True}
    response = await whole(
        client,
        instructions="Be brief.",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        temperature=0.5,
        top_p=0.9,
        max_output_tokens=12,
        metadata={"session": "42"},
        text={"format": fmt},
        reasoning={"effort": "low"},
        store=False,
    )
    assert response.instructions == "Be brief."
    assert [tool.to_dict() for tool in response.tools] == [WEATHER]
    assert response.tool_choice.to_dict() == {"type": "function", "name": "get_weather"}
    assert response.parallel_tool_calls is False
    assert (response.temperature, response.top_p, response.max_output_tokens) == (0.5, 0.9, 12)
    assert response.metadata == {"session": "42"}
    assert response.text is not None and response.text.format is not None
    assert response.text.format.to_dict() == fmt
    assert response.reasoning is not None and response.reasoning.effort == "low"
    assert response.previous_response_id is None
    defaults = await whole(client)
    assert (defaults.tool_choice, defaults.tools, defaults.parallel_tool_calls) == (
        "auto",
        [],
        True,
    )
    assert (defaults.temperature, defaults.top_p, defaults.metadata) == (1.0, 1.0, {})
    assert defaults.text is not None and defaults.text.format is not None
    assert defaults.text.format.type == "text"


async def test_tool_calls_follow_the_text_as_function_call_items(client: TestClient) -> None:
    response = await whole(client, input="tool-call", tools=[WEATHER, TIME])
    assert response.status == "completed"
    assert [item.type for item in response.output] == ["message", "function_call", "function_call"]
    assert response.output_text == TOOL_TEXT
    calls = response.output[1:]
    for item, call in zip(calls, TOOL_CALLS, strict=True):
        assert item.type == "function_call" and item.id is not None
        assert item.id.startswith("fc_")
        assert (item.call_id, item.name, item.arguments) == (call.id, call.name, call.arguments)
        assert item.status == "completed"
    assert len({item.id for item in response.output}) == 3


async def test_reasoning_comes_first_as_a_reasoning_item(client: TestClient) -> None:
    response = await whole(client, input="reasoning")
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert reasoning.summary == []
    assert reasoning.content is not None
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", REASONING_TEXT)]
    assert message.type == "message" and response.output_text == HELLO
    assert response.usage is not None
    assert response.usage.output_tokens_details.reasoning_tokens == len(REASONING)


async def test_token_limit_makes_the_response_incomplete(client: TestClient) -> None:
    response = await whole(client, input="length", max_output_tokens=3)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.status == "incomplete"
    assert response.output_text == HELLO


# --- requests as admission messages ------------------------------------------------------


async def test_input_items_become_the_chat_messages(client: TestClient, scripted: Scripted) -> None:
    items = [
        {"role": "system", "content": "sys"},
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "d"}]},
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
        },
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "hmm"}],
        },
        {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Let me check.", "annotations": []}],
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "c1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
            "status": "completed",
        },
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {
            "type": "function_call_output",
            "call_id": "c2",
            "output": [{"type": "input_text", "text": "noon"}],
        },
        {"type": "function_call", "call_id": "c3", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c3", "output": "one"},
        {"role": "user", "content": "hello", "some_future_field": 1},
    ]
    await whole(client, input=items, instructions="Be brief.", user="ignored", include=[])

    def call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }

    assert admitted(scripted).messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "sys"},
        {"role": "developer", "content": "d"},
        {"role": "user", "content": "a\nb"},
        # The answer's text and the calls that followed it are one assistant turn.
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                call("c1", "get_weather", '{"city": "Paris"}'),
                call("c2", "get_time", "{}"),
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
        {"role": "assistant", "content": "", "tool_calls": [call("c3", "get_time", "{}")]},
        {"role": "tool", "tool_call_id": "c3", "content": "one"},
        {"role": "user", "content": "hello"},
    ]


async def test_tools_choice_format_and_sampling_reach_admission(
    client: TestClient, scripted: Scripted
) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    await whole(
        client,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "name": "get_time"},
        parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "out", "schema": schema}},
        max_output_tokens=20,
        temperature=0.2,
        top_p=0.5,
    )
    msg = admitted(scripted)
    assert msg.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city.",
                "parameters": WEATHER["parameters"],
            },
        },
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
    ]
    assert msg.tool_choice == ToolChoice(mode="function", name="get_time", parallel=False)
    assert msg.response_format == OutputFormat(type="json_schema", schema=schema, name="out")
    s = msg.sampling
    assert (s.max_tokens, s.temperature, s.top_p) == (20, 0.2, 0.5)


async def test_unsent_fields_keep_the_defaults(client: TestClient, scripted: Scripted) -> None:
    await whole(client, temperature=None, tools=None, text={"format": {"type": "text"}})
    msg = admitted(scripted)
    assert msg.messages == [{"role": "user", "content": "hello"}]
    assert msg.tools is None and msg.tool_choice == ToolChoice()
    assert msg.response_format is None
    assert (msg.sampling.max_tokens, msg.sampling.temperature) == (77, 1.0)


@pytest.mark.parametrize("choice", ["auto", "required", "none"])
async def test_tool_choice_modes(client: TestClient, scripted: Scripted, choice: str) -> None:
    await whole(client, tools=[WEATHER], tool_choice=choice)
    msg = admitted(scripted)
    # The tools go even with "none", as chat sends them: admission hides them by the mode.
    assert msg.tool_choice == ToolChoice(mode=choice)
    assert msg.tools is not None and len(msg.tools) == 1


async def test_json_object_format(client: TestClient, scripted: Scripted) -> None:
    await whole(client, text={"format": {"type": "json_object"}})
    assert admitted(scripted).response_format == OutputFormat(type="json_object")


# --- streams -------------------------------------------------------------------------------

_TEXT_EVENTS = [
    "response.output_item.added",
    "response.content_part.added",
    *["response.output_text.delta"] * len(http_stack.DELTAS),
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]
_CALL_EVENTS = [
    "response.output_item.added",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
]


async def test_stream_sends_the_text_events_in_order(client: TestClient) -> None:
    data = await events(client)
    assert types(data) == [
        "response.created",
        "response.in_progress",
        *_TEXT_EVENTS,
        "response.completed",
    ]
    created = data[0]["response"]
    assert (created["status"], created["output"], created["usage"]) == ("in_progress", [], None)
    item = data[2]["item"]
    assert (item["type"], item["status"], item["content"]) == ("message", "in_progress", [])
    deltas = [e for e in data if e["type"] == "response.output_text.delta"]
    assert [e["delta"] for e in deltas] == http_stack.DELTAS
    assert {(e["item_id"], e["output_index"], e["content_index"]) for e in deltas} == {
        (item["id"], 0, 0)
    }
    assert data[-4]["text"] == HELLO
    final = Response.model_validate(data[-1]["response"])
    assert final.status == "completed" and final.output_text == HELLO
    assert final.id == created["id"] and final.output[0].id == item["id"]
    assert final.usage is not None and final.usage.total_tokens == 9


async def test_stream_sends_each_tool_call_whole(client: TestClient) -> None:
    data = await events(client, input="tool-call", tools=[WEATHER, TIME])
    assert types(data) == [
        "response.created",
        "response.in_progress",
        *[t for t in _TEXT_EVENTS if t != "response.output_text.delta"][:2],
        "response.output_text.delta",
        *_TEXT_EVENTS[-3:],
        *_CALL_EVENTS,
        *_CALL_EVENTS,
        "response.completed",
    ]
    added = [e for e in data if e["type"] == "response.output_item.added"][1:]
    assert [(e["output_index"], e["item"]["arguments"], e["item"]["status"]) for e in added] == [
        (1, "", "in_progress"),
        (2, "", "in_progress"),
    ]
    arguments = [e for e in data if e["type"] == "response.function_call_arguments.done"]
    assert [(e["name"], e["arguments"]) for e in arguments] == [
        (call.name, call.arguments) for call in TOOL_CALLS
    ]
    final = Response.model_validate(data[-1]["response"])
    assert [item.type for item in final.output] == ["message", "function_call", "function_call"]


async def test_stream_sends_reasoning_before_the_text(client: TestClient) -> None:
    data = await events(client, input="reasoning")
    assert types(data) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.reasoning_text.delta"] * len(REASONING),
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        *_TEXT_EVENTS,
        "response.completed",
    ]
    assert data[2]["item"]["type"] == "reasoning"
    assert data[3]["part"] == {"type": "reasoning_text", "text": ""}
    assert data[2 + 2 + len(REASONING)]["text"] == REASONING_TEXT
    assert {e["output_index"] for e in data if e["type"] == "response.output_text.delta"} == {1}


async def test_stream_at_the_token_limit_ends_incomplete(client: TestClient) -> None:
    data = await events(client, input="length")
    assert data[-1]["type"] == "response.incomplete"
    final = Response.model_validate(data[-1]["response"])
    assert final.status == "incomplete"
    assert final.incomplete_details is not None
    assert final.incomplete_details.reason == "max_output_tokens"
    assert data[-2]["item"]["status"] == "incomplete"


async def test_stream_and_whole_answer_hold_the_same_output(client: TestClient) -> None:
    for script in ("hello", "tool-call", "reasoning", "length"):
        data = await events(client, input=script)
        streamed = data[-1]["response"]
        answered = await (await client.post(RESPONSES, json=body(script))).json()
        for response in (streamed, answered):
            for item in response["output"]:
                item.pop("id")
        assert streamed["output"] == answered["output"]
        assert streamed["usage"] == answered["usage"]


async def test_failure_after_the_stream_began_is_response_failed(client: TestClient) -> None:
    data = await events(client, input="fail-mid-stream")
    assert types(data) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.failed",
    ]
    failed = Response.model_validate(data[-1]["response"])
    assert failed.status == "failed"
    assert failed.error is not None and failed.error.code == "server_error"
    assert failed.error.message == "Out of memory during decode."
    [message] = failed.output
    assert message.type == "message" and message.status == "incomplete"
    assert failed.output_text == "partial"
    await assert_still_serving(client)


async def test_failure_without_stream_answers_the_error_status(client: TestClient) -> None:
    resp = await client.post(RESPONSES, json=body("fail-mid-stream"))
    assert resp.status == 503
    error = assert_error_shape(await resp.json(), param=None)
    assert error["message"] == "Out of memory during decode."
    await assert_still_serving(client)


@pytest.mark.parametrize("stream", [False, True])
async def test_refusal_before_start_is_a_plain_error_not_a_stream(
    client: TestClient, stream: bool
) -> None:
    resp = await client.post(RESPONSES, json=body("refuse-before-start", stream=stream))
    assert resp.status == 429
    assert resp.headers["Content-Type"].startswith("application/json")
    assert assert_error_shape(await resp.json(), param=None)["type"] == "rate_limit_error"
    resp = await client.post(RESPONSES, json={**body(stream=stream), "model": BUSY_MODEL})
    assert resp.status == 429 and resp.headers["Retry-After"] == "3"
    await assert_still_serving(client)


# --- bad requests --------------------------------------------------------------------------

BAD = [
    pytest.param(body(conversation="conv_1"), "conversation", id="conversation"),
    pytest.param(body(background=True), "background", id="background"),
    pytest.param(body(tools=[{"type": "custom"}]), "tools[0].name", id="custom-without-name"),
    pytest.param(
        body(tools=[{"type": "custom", "name": "f", "format": {"type": "grammar"}}]),
        "tools[0].format",
        id="custom-format-without-syntax",
    ),
    pytest.param(
        body(tools=[{"type": "custom", "name": "f",
                     "format": {"type": "grammar", "syntax": "lark"}}]),
        "tools[0].format.definition",
        id="custom-grammar-without-definition",
    ),
    pytest.param(
        body(tools=[WEATHER, {"type": "custom", "name": "f",
                              "format": {"type": "grammar", "syntax": "lark",
                                         "definition": "start: %json {}"}}],
             tool_choice={"type": "custom", "name": "f"}),
        "tools[1].format",
        id="enforced-grammar-with-json",
    ),
    pytest.param(
        body(tools=[{"type": "custom", "name": "f",
                     "format": {"type": "grammar", "syntax": "regex", "definition": "a("}}],
             tool_choice="required"),
        "tools[0].format",
        id="enforced-bad-regex",
    ),
    pytest.param(
        body(tools=[WEATHER, {"type": "web_search"}], tool_choice={"type": "web_search"}),
        "tool_choice",
        id="choice-of-a-dropped-tool",
    ),
    pytest.param(
        body(tools=[WEATHER], tool_choice={"type": "custom", "name": "get_weather"}),
        "tool_choice",
        id="custom-choice-naming-a-function",
    ),
    pytest.param(
        body(tools=[{"type": "web_search"}], tool_choice="required"),
        "tool_choice",
        id="required-with-only-dropped-tools",
    ),
    pytest.param(
        body([{"type": "custom_tool_call", "call_id": "c", "name": "f"}]),
        "input[0].input",
        id="custom-call-without-input",
    ),
    pytest.param(
        body([{"type": "local_shell_call", "call_id": "c", "action": {"type": "exec"}}]),
        "input[0].action.command",
        id="local-shell-call-without-command",
    ),
    pytest.param(
        body([{"type": "custom_tool_call_output", "call_id": "c"}]),
        "input[0].output",
        id="custom-call-output-without-output",
    ),
    pytest.param(
        body(tools=[WEATHER, {"type": "function"}]), "tools[1].name", id="tool-without-name"
    ),
    pytest.param(body(tools={"type": "function", "name": "f"}), "tools", id="tools-not-a-list"),
    pytest.param(
        body(tools=[WEATHER], tool_choice={"type": "function", "name": "nope"}),
        "tool_choice",
        id="unknown-tool-choice-name",
    ),
    pytest.param(
        body(tools=[WEATHER], tool_choice="sometimes"), "tool_choice", id="unknown-tool-choice-mode"
    ),
    pytest.param(body(tool_choice="required"), "tool_choice", id="required-without-tools"),
    pytest.param(
        body(tools=[WEATHER], tool_choice={"type": "file_search"}),
        "tool_choice",
        id="built-in-tool-choice",
    ),
    pytest.param(
        body(text={"format": {"type": "grammar"}}), "text.format.type", id="unknown-text-format"
    ),
    pytest.param(
        body(text={"format": {"type": "json_schema", "name": "x"}}),
        "text.format.schema",
        id="json-schema-without-schema",
    ),
    pytest.param({"model": MODEL}, "input", id="missing-input"),
    pytest.param(body([]), "input", id="empty-input"),
    pytest.param(
        body([{"type": "item_reference", "id": "msg_1"}]), "input[0].type", id="item-reference"
    ),
    pytest.param(
        body([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
        "input[0].content[0].image_url",
        id="malformed-image-url",
    ),
    pytest.param(
        body([{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]),
        "input[0].content[0].type",
        id="file-part",
    ),
    pytest.param(body([{"role": "tool", "content": "x"}]), "input[0].role", id="tool-role"),
    pytest.param(
        body([{"type": "function_call", "name": "f", "arguments": "{}"}]),
        "input[0].call_id",
        id="function-call-without-call-id",
    ),
    pytest.param(
        body([{"type": "function_call_output", "call_id": "c1"}]),
        "input[0].output",
        id="function-call-output-without-output",
    ),
    pytest.param(body(temperature=3), "temperature", id="temperature-above-2"),
    pytest.param(body(max_output_tokens=0), "max_output_tokens", id="max-output-tokens-zero"),
]


@pytest.mark.parametrize(("payload", "param"), BAD)
async def test_bad_request_is_400_in_error_shape_and_server_keeps_serving(
    client: TestClient, scripted: Scripted, payload: dict[str, Any], param: str
) -> None:
    resp = await client.post(RESPONSES, json=payload)
    assert resp.status == 400
    error = assert_error_shape(await resp.json(), param=param)
    assert error["type"] == "invalid_request_error"
    assert scripted.seen == []  # refused before admission
    await assert_still_serving(client)


async def test_refusals_say_what_to_do(client: TestClient) -> None:
    resp = await client.post(RESPONSES, json=body(conversation="conv_1"))
    assert "previous_response_id" in (await resp.json())["error"]["message"]
    resp = await client.post(RESPONSES, json=body(
        tools=[{"type": "custom", "name": "f", "format": {
            "type": "grammar", "syntax": "lark", "definition": "start: <|im_end|>"}}],
        tool_choice="required"))
    assert "special tokens" in (await resp.json())["error"]["message"]
    resp = await client.post(RESPONSES, data=b"{", headers={"Content-Type": "application/json"})
    assert resp.status == 400


# --- the official openai client --------------------------------------------------------------




async def test_openai_client_create(openai_client: openai.AsyncOpenAI) -> None:
    response = await openai_client.responses.create(
        model=MODEL, input="hello", instructions="Be brief.", max_output_tokens=16
    )
    assert response.output_text == HELLO and response.status == "completed"
    assert response.usage is not None and response.usage.input_tokens_details.cached_tokens == 2


async def test_openai_client_stream(openai_client: openai.AsyncOpenAI) -> None:
    async with openai_client.responses.stream(model=MODEL, input="hello") as stream:
        deltas = [
            event.delta async for event in stream if event.type == "response.output_text.delta"
        ]
        final = await stream.get_final_response()
    assert "".join(deltas) == HELLO
    assert final.output_text == HELLO and final.status == "completed"


async def test_openai_client_tool_round_trip(
    openai_client: openai.AsyncOpenAI, scripted: Scripted
) -> None:
    """As the Agents SDK does: the answer's items go back as input, with the calls' outputs."""
    tools: Any = [WEATHER, TIME]
    async with openai_client.responses.stream(model=MODEL, input="tool-call", tools=tools) as s:
        arguments = [
            event.arguments
            async for event in s
            if event.type == "response.function_call_arguments.done"
        ]
        first = await s.get_final_response()
    assert arguments == [call.arguments for call in TOOL_CALLS]
    calls = [item for item in first.output if item.type == "function_call"]
    assert [(c.call_id, c.name, json.loads(c.arguments)) for c in calls] == [
        (call.id, call.name, json.loads(call.arguments)) for call in TOOL_CALLS
    ]
    items: Any = [
        {"role": "user", "content": "tool-call"},
        *[item.model_dump() for item in first.output],
        *[{"type": "function_call_output", "call_id": c.call_id, "output": "42"} for c in calls],
    ]
    second = await openai_client.responses.create(model=MODEL, input=items, tools=tools)
    assert second.output_text == HELLO
    assert admitted(scripted).messages == [
        {"role": "user", "content": "tool-call"},
        {
            "role": "assistant",
            "content": TOOL_TEXT,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in TOOL_CALLS
            ],
        },
        *[{"role": "tool", "tool_call_id": call.id, "content": "42"} for call in TOOL_CALLS],
    ]


async def test_openai_client_reasoning_and_incomplete(openai_client: openai.AsyncOpenAI) -> None:
    async with openai_client.responses.stream(model=MODEL, input="reasoning") as stream:
        thoughts = [
            event.delta async for event in stream if event.type == "response.reasoning_text.delta"
        ]
        final = await stream.get_final_response()
    assert "".join(thoughts) == REASONING_TEXT
    assert [item.type for item in final.output] == ["reasoning", "message"]
    # At the token limit the stream ends with response.incomplete, as OpenAI's does (the
    # stream helper's get_final_response waits for response.completed, so read the events).
    stream = await openai_client.responses.create(model=MODEL, input="length", stream=True)
    last = [event async for event in stream][-1]
    assert last.type == "response.incomplete"
    assert last.response.status == "incomplete"
    response = await openai_client.responses.create(model=MODEL, input="length")
    assert response.status == "incomplete" and response.output_text == HELLO


async def test_openai_client_sees_refusals_as_errors(openai_client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        await openai_client.responses.create(model=MODEL, input="hello", background=True)
    assert bad.value.param == "background"
    with pytest.raises(openai.BadRequestError) as missing:
        await openai_client.responses.create(
            model=MODEL, input="hello", previous_response_id="resp_1"
        )
    assert missing.value.param == "previous_response_id"
    assert missing.value.code == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        await openai_client.responses.create(model="no-such-model", input="hello")


# --- Codex's requests on the real stack (the tiny model) ---------------------------------------


async def test_codex_request_is_served_with_max_output_tokens_cut_to_the_room_left(
    tiny_short_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TROUPE_HOME", str(tmp_path))
    async with real_stack(tiny_short_dir) as stack:  # a 64-token context
        client = openai.AsyncOpenAI(base_url=f"{stack.server.url}/v1", api_key="x",
                                    max_retries=0)
        try:
            response = await client.responses.create(
                model="gpt-5-codex", input="The quick brown fox", max_output_tokens=32000,
                temperature=0)
        finally:
            await client.close()
    assert response.model == stack.model == "tiny-short"
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens + response.usage.output_tokens == 64


# --- Codex: custom and local_shell tools, hosted tools, reasoning sent back ------------------

CUSTOM = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files.",
    "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_GRAMMAR},
}
LOCAL_SHELL = {"type": "local_shell"}


async def test_custom_tool_reaches_admission_as_a_function_of_one_string(
    client: TestClient, scripted: Scripted
) -> None:
    text_tool = {"type": "custom", "name": "note", "format": {"type": "text"}}
    regex_tool = {"type": "custom", "name": "pick",
                  "format": {"type": "grammar", "syntax": "regex", "definition": "[ab]+"}}
    await whole(client, tools=[CUSTOM, text_tool, regex_tool, WEATHER])
    msg = admitted(scripted)
    assert msg.tools is not None
    functions = {tool["function"]["name"]: tool["function"] for tool in msg.tools}
    string_input = {"type": "object", "properties": {"input": {"type": "string"}},
                    "required": ["input"], "additionalProperties": False}
    for name in ("apply_patch", "note", "pick"):
        assert functions[name]["parameters"] == string_input
    # The grammar is all a model learns of the format: it follows the description.
    assert functions["apply_patch"]["description"] == (
        f"Edit files.\n\nThe input is text in this Lark grammar:\n{APPLY_PATCH_GRAMMAR}"
    )
    assert functions["pick"]["description"] == (
        "The input is text in this regular expression:\n[ab]+"
    )
    assert "description" not in functions["note"]
    assert msg.tool_choice.input_formats == {
        "apply_patch": OutputFormat(type="lark", pattern=APPLY_PATCH_GRAMMAR),
        "pick": OutputFormat(type="regex", pattern="[ab]+"),
    }


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "custom", "name": "apply_patch"}, ToolChoice(mode="function",
                                                               name="apply_patch")),
        ("required", ToolChoice(mode="required")),
    ],
)
async def test_custom_choices_enforce_their_calls(
    client: TestClient, scripted: Scripted, choice: Any, expected: ToolChoice
) -> None:
    await whole(client, tools=[CUSTOM, LOCAL_SHELL], tool_choice=choice)
    got = admitted(scripted).tool_choice
    assert (got.mode, got.name) == (expected.mode, expected.name)
    assert got.input_formats is not None and set(got.input_formats) == {"apply_patch"}


async def test_custom_call_comes_back_as_a_custom_tool_call_item(client: TestClient) -> None:
    response = await whole(client, input="custom-call", tools=[CUSTOM])
    [item] = response.output
    assert item.type == "custom_tool_call" and item.id is not None
    assert item.id.startswith("ctc_")
    assert (item.call_id, item.name, item.input) == ("call_p", "apply_patch", PATCH)
    # As codex-rs reads it: ResponseItem::CustomToolCall { call_id, name, input }.
    raw = await (await client.post(RESPONSES, json=body("custom-call", tools=[CUSTOM]))).json()
    assert {k: raw["output"][0][k] for k in ("type", "call_id", "name", "input")} == {
        "type": "custom_tool_call", "call_id": "call_p", "name": "apply_patch", "input": PATCH}


async def test_custom_call_input_that_is_not_one_string_keeps_the_arguments() -> None:
    from troupe.api.responses_tools import freeform_input

    assert freeform_input('{"input": "x"}') == "x"
    for arguments in ('{"input": "x", "more": 1}', '{"input": 3}', "[1]", "not json"):
        assert freeform_input(arguments) == arguments


async def test_stream_sends_a_custom_call_in_codexs_event_order(client: TestClient) -> None:
    data = await events(client, input="custom-call", tools=[CUSTOM])
    assert types(data) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, delta, done, item_done = data[2:6]
    assert added["item"]["type"] == "custom_tool_call" and added["item"]["input"] == ""
    item_id = added["item"]["id"]
    assert (delta["item_id"], delta["output_index"], delta["delta"]) == (item_id, 0, PATCH)
    assert (done["item_id"], done["output_index"], done["input"]) == (item_id, 0, PATCH)
    assert item_done["item"] == {**added["item"], "input": PATCH}
    final = Response.model_validate(data[-1]["response"])
    assert [(i.type, i.input) for i in final.output] == [("custom_tool_call", PATCH)]


async def test_openai_client_stream_parses_a_custom_call(
    openai_client: openai.AsyncOpenAI,
) -> None:
    tools: Any = [CUSTOM]
    async with openai_client.responses.stream(model=MODEL, input="custom-call",
                                              tools=tools) as stream:
        seen = [event async for event in stream]
        final = await stream.get_final_response()
    kinds = [event.type for event in seen]
    assert "response.custom_tool_call_input.delta" in kinds
    done = next(e for e in seen if e.type == "response.custom_tool_call_input.done")
    assert done.input == PATCH
    [call] = final.output
    assert call.type == "custom_tool_call" and call.input == PATCH


async def test_earlier_custom_call_goes_back_as_the_call_the_model_wrote(
    client: TestClient, scripted: Scripted
) -> None:
    first = await (await client.post(RESPONSES, json=body("custom-call", tools=[CUSTOM]))).json()
    items = [
        {"role": "user", "content": "custom-call"},
        *first["output"],
        {"type": "custom_tool_call_output", "call_id": "call_p", "output": "Done!"},
        {"role": "user", "content": "hello"},
    ]
    await whole(client, input=items, tools=[CUSTOM])
    assert admitted(scripted).messages == [
        {"role": "user", "content": "custom-call"},
        {
            "role": "assistant",
            "content": "",
            # Byte for byte the arguments the engine parsed from the model's call.
            "tool_calls": [{"id": "call_p", "type": "function", "function": {
                "name": "apply_patch", "arguments": CUSTOM_CALL.arguments}}],
        },
        {"role": "tool", "tool_call_id": "call_p", "content": "Done!"},
        {"role": "user", "content": "hello"},
    ]


async def test_local_shell_call_out_and_back(client: TestClient, scripted: Scripted) -> None:
    data = await events(client, input="shell-call", tools=[LOCAL_SHELL])
    assert types(data)[2:5] == [
        "response.output_item.added", "response.output_item.done", "response.completed"]
    item = data[3]["item"]
    assert item["type"] == "local_shell_call" and item["id"].startswith("lsh_")
    assert (item["call_id"], item["status"]) == ("call_s", "completed")
    assert item["action"] == {"type": "exec", "command": ["ls", "-la"], "timeout_ms": None,
                              "working_directory": "/tmp", "env": {}, "user": None}
    final = Response.model_validate(data[-1]["response"])
    assert final.output[0].type == "local_shell_call"
    # Codex answers a local_shell call with a function_call_output; OpenAI's item names the
    # call by its id: both go back as the call's tool message.
    for output in ({"type": "function_call_output", "call_id": "call_s", "output": "a.txt"},
                   {"type": "local_shell_call_output", "id": "call_s", "output": "a.txt"}):
        await whole(client, input=[{"role": "user", "content": "shell-call"}, item, output],
                    tools=[LOCAL_SHELL])
        assert admitted(scripted).messages[1:] == [
            {"role": "assistant", "content": "", "tool_calls": [{
                "id": "call_s", "type": "function",
                "function": {"name": "local_shell", "arguments": SHELL_CALL.arguments}}]},
            {"role": "tool", "tool_call_id": "call_s", "content": "a.txt"},
        ]
    tools = admitted(scripted).tools
    assert tools is not None and tools[0]["function"]["name"] == "local_shell"
    assert tools[0]["function"]["parameters"]["required"] == ["command"]


async def test_local_shell_call_that_is_not_an_exec_action_is_a_function_call() -> None:
    from troupe.api.responses_tools import local_shell_action

    assert local_shell_action('{"command": ["ls"], "workdir": "/w", "timeout_ms": 5}') == {
        "type": "exec", "command": ["ls"], "timeout_ms": 5, "working_directory": "/w",
        "env": {}, "user": None}
    for arguments in ('{"command": "ls"}', '{"command": []}', '{"command": ["ls"], '
                      '"timeout_ms": "soon"}', "[]", "nope"):
        assert local_shell_action(arguments) is None


async def test_reasoning_items_sent_back_are_accepted_and_left_out(
    client: TestClient, scripted: Scripted
) -> None:
    items = [
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "id": "rs_1", "encrypted_content": "gAAAAB...opaque",
         "summary": [{"type": "summary_text", "text": "Thinking about hi."}]},
        {"type": "reasoning", "id": "rs_2", "summary": [], "content": None,
         "encrypted_content": None},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Hi!"}]},
        {"role": "user", "content": "hello"},
    ]
    await whole(client, input=items)
    assert admitted(scripted).messages == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "hello"},
    ]


async def test_codex_request_fields_are_accepted_and_ignored(
    client: TestClient, scripted: Scripted
) -> None:
    odd: dict[str, Any] = {
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "session-1",
        "text": {"verbosity": "low", "format": {"type": "text"}},
        "reasoning": {"effort": "high", "summary": "detailed"},
        "store": False,
        "service_tier": "auto",
        "user": "me",
        "safety_identifier": "hash",
        "truncation": "auto",
        "stream_options": {"include_obfuscation": False},
        "top_logprobs": 0,
        "max_tool_calls": 3,
        "prompt": {"id": "pmpt_1"},
    }
    response = await whole(client, **odd)
    assert response.output_text == HELLO and response.store is False
    # Ignored fields in shapes nobody defined here are not refused either.
    weird = {"include": "all", "prompt_cache_key": 7, "service_tier": ["x"], "user": {},
             "truncation": 1, "stream_options": "yes", "text": {"verbosity": 3}}
    assert (await whole(client, **weird)).output_text == HELLO


async def test_hosted_tools_are_dropped_and_named_in_a_warning(
    client: TestClient, scripted: Scripted, caplog: pytest.LogCaptureFixture
) -> None:
    hosted = [{"type": "web_search", "filters": {"allowed_domains": ["a.com"]}},
              {"type": "file_search", "vector_store_ids": ["vs_1"]},
              {"type": "code_interpreter", "container": {"type": "auto"}},
              {"type": "image_generation", "output_format": "png"},
              {"type": "computer_use_preview", "display_width": 1024},
              {"type": "mcp", "server_label": "x", "server_url": "https://x"}]
    for stream in (False, True):
        resp = await client.post(RESPONSES, json=body(tools=[*hosted, WEATHER], stream=stream))
        assert resp.status == 200
        assert resp.headers["Warning"] == (
            '299 mlx-troupe "tools this server cannot run were dropped: web_search, '
            'file_search, code_interpreter, image_generation, computer_use_preview, mcp"'
        )
        await resp.read()
        msg = admitted(scripted)
        assert msg.tools is not None and [t["function"]["name"] for t in msg.tools] == [
            "get_weather"]
    assert sum("were dropped: web_search" in r.getMessage() for r in caplog.records
               if r.levelname == "WARNING") == 2
    resp = await client.post(RESPONSES, json=body(tools=[WEATHER]))
    assert "Warning" not in resp.headers
    # A type is the client's text: a line break or a quote in it stays inside the header
    # (aiohttp would refuse to send the header, and the client would get no answer at all).
    odd = 'x"\r\nX-Injected: 1\u0000é'
    resp = await client.post(RESPONSES, json=body(tools=[{"type": odd}, WEATHER]))
    assert resp.status == 200, await resp.text()
    assert "X-Injected" not in resp.headers
    assert resp.headers["Warning"] == ('299 mlx-troupe "tools this server cannot run were '
                                       'dropped: x\\"\\r\\nX-Injected: 1\\u0000\\u00e9"')
    # Only hosted tools: the request is served without tools.
    response = await whole(client, tools=[{"type": "web_search_preview"}])
    assert response.tools == [] and admitted(scripted).tools is None


async def test_an_unenforced_grammar_is_not_checked(client: TestClient) -> None:
    """Codex sends tool_choice auto: a grammar nothing enforces is served as it is."""
    tool = {"type": "custom", "name": "f",
            "format": {"type": "grammar", "syntax": "lark", "definition": "start: %json {}"}}
    assert (await whole(client, tools=[tool])).output_text == HELLO


async def test_response_echoes_custom_and_local_shell_tools(client: TestClient) -> None:
    response = await whole(client, tools=[CUSTOM, LOCAL_SHELL, {"type": "web_search"}],
                           tool_choice={"type": "custom", "name": "apply_patch"})
    assert [tool.to_dict() for tool in response.tools] == [CUSTOM, LOCAL_SHELL]
    assert response.tool_choice.to_dict() == {"type": "custom", "name": "apply_patch"}


# --- stored responses: previous_response_id, GET and DELETE -----------------------------------


async def test_responses_are_stored_unless_store_is_false(client: TestClient) -> None:
    kept = await whole(client)
    assert kept.store is True
    resp = await client.get(f"{RESPONSES}/{kept.id}")
    assert resp.status == 200
    assert Response.model_validate(await resp.json()) == kept
    unkept = await whole(client, store=False)
    assert unkept.store is False
    resp = await client.get(f"{RESPONSES}/{unkept.id}")
    assert resp.status == 404
    error = assert_error_shape(await resp.json(), param=None)
    assert error["code"] == "response_not_found"
    resp = await client.post(RESPONSES, json=body(previous_response_id=unkept.id))
    assert resp.status == 400


async def test_previous_response_id_continues_the_stored_conversation(
    client: TestClient, scripted: Scripted
) -> None:
    first = await whole(client, input=[{"role": "user", "content": "tool-call"}],
                        instructions="First rules.", tools=[WEATHER, TIME])
    second = await whole(
        client,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.id, "output": "42"}
               for call in TOOL_CALLS],
        instructions="Second rules.",
        tools=[WEATHER, TIME],
    )
    assert second.previous_response_id == first.id
    calls = [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                          "arguments": c.arguments}}
             for c in TOOL_CALLS]
    tool_results = [{"role": "tool", "tool_call_id": c.id, "content": "42"} for c in TOOL_CALLS]
    # The first request's instructions are not carried over; its items are.
    assert admitted(scripted).messages == [
        {"role": "system", "content": "Second rules."},
        {"role": "user", "content": "tool-call"},
        {"role": "assistant", "content": TOOL_TEXT, "tool_calls": calls},
        *tool_results,
    ]
    # A chain of three: the second's items (and so the first's) come before the third's.
    third = await whole(client, previous_response_id=second.id, input="hello")
    assert admitted(scripted).messages == [
        {"role": "user", "content": "tool-call"},
        {"role": "assistant", "content": TOOL_TEXT, "tool_calls": calls},
        *tool_results,
        {"role": "assistant", "content": HELLO},
        {"role": "user", "content": "hello"},
    ]
    assert third.output_text == HELLO


async def test_a_bad_item_after_a_continued_response_is_named_in_the_requests_input(
    client: TestClient,
) -> None:
    first = await whole(client)
    resp = await client.post(RESPONSES, json=body(
        [{"role": "user", "content": "hi"}, {"type": "function_call", "name": "f"}],
        previous_response_id=first.id))
    assert resp.status == 400
    assert_error_shape(await resp.json(), param="input[1].call_id")


async def test_a_missed_previous_response_is_400_in_openais_shape(client: TestClient) -> None:
    resp = await client.post(RESPONSES, json=body(previous_response_id="resp_gone"))
    assert resp.status == 400
    error = assert_error_shape(await resp.json(), param="previous_response_id")
    assert (error["type"], error["code"]) == ("invalid_request_error",
                                              "previous_response_not_found")
    assert "resp_gone" in error["message"]
    await assert_still_serving(client)


async def test_the_store_keeps_the_most_recently_used(
    aiohttp_client: Any, scripted: Scripted
) -> None:
    client = await aiohttp_client(scripted.app(responses_store=2))
    a, b = await whole(client), await whole(client)
    assert (await client.get(f"{RESPONSES}/{a.id}")).status == 200  # a is now the newest
    c = await whole(client)
    assert (await client.get(f"{RESPONSES}/{b.id}")).status == 404  # b was the oldest
    assert (await client.get(f"{RESPONSES}/{a.id}")).status == 200
    assert (await client.get(f"{RESPONSES}/{c.id}")).status == 200


async def test_a_store_of_size_zero_keeps_nothing(aiohttp_client: Any, scripted: Scripted) -> None:
    client = await aiohttp_client(scripted.app(responses_store=0))
    response = await whole(client, store=True)
    assert response.store is False
    assert (await client.get(f"{RESPONSES}/{response.id}")).status == 404


async def test_a_failed_stream_is_not_stored_and_a_stream_that_ends_is(
    client: TestClient,
) -> None:
    failed = await events(client, input="fail-mid-stream")
    response_id = failed[-1]["response"]["id"]
    assert (await client.get(f"{RESPONSES}/{response_id}")).status == 404
    for script in ("hello", "length"):
        ended = await events(client, input=script)
        stored = await client.get(f"{RESPONSES}/{ended[-1]['response']['id']}")
        assert stored.status == 200
        assert await stored.json() == ended[-1]["response"]


async def test_delete_forgets_a_stored_response(client: TestClient) -> None:
    response = await whole(client)
    resp = await client.delete(f"{RESPONSES}/{response.id}")
    assert resp.status == 200
    assert await resp.json() == {"id": response.id, "object": "response.deleted",
                                 "deleted": True}
    assert (await client.get(f"{RESPONSES}/{response.id}")).status == 404
    resp = await client.delete(f"{RESPONSES}/{response.id}")
    assert resp.status == 404


async def test_openai_client_chains_retrieves_and_deletes(
    openai_client: openai.AsyncOpenAI, scripted: Scripted
) -> None:
    tools: Any = [CUSTOM]
    first = await openai_client.responses.create(model=MODEL, input="custom-call", tools=tools)
    second = await openai_client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=tools,
        input=[{"type": "custom_tool_call_output", "call_id": "call_p", "output": "ok"}])
    assert second.previous_response_id == first.id
    assert admitted(scripted).messages[1]["tool_calls"][0]["function"]["arguments"] == (
        CUSTOM_CALL.arguments)
    assert (await openai_client.responses.retrieve(second.id)).output_text == HELLO
    await openai_client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        await openai_client.responses.retrieve(second.id)
