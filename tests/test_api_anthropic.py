"""Anthropic's Messages API: shapes, streams and errors (scripted admission), then the official
``anthropic`` client against the real serving stack on the tiny model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import anthropic
import http_stack
import openai
import pytest
from aiohttp.test_utils import TestClient
from http_stack import (
    BUSY_MODEL,
    DELTAS,
    MODEL,
    REASONING,
    STOP,
    TOOL_CALLS,
    TOOL_TEXT,
    Scripted,
    parse_named_sse,
    real_stack,
)
from mlx_lm.utils import load_tokenizer

from troupe.actors.admission import Admission
from troupe.actors.config import ServeConfig
from troupe.actors.messages import (
    AddRequest,
    AdmitChat,
    Admitted,
    CountTokens,
    ModelCard,
    OutputFormat,
    RequestFinished,
    SamplingParams,
    TokensGenerated,
    ToolCall,
    ToolChoice,
    Usage,
)
from troupe.api.anthropic import MessagesRenderer, MessagesRequest
from troupe.api.app import create_app
from troupe.api.stops import MAX_STOP_CHARS, MAX_STOPS
from troupe.runtime import Actor, ActorSystem

MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"


# The scripted stack's fixtures, bound here by name so that pytest finds them.
scripted, client = http_stack.scripted, http_stack.client


WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
CLOCK = {"name": "get_time", "input_schema": {"type": "object",
                                              "properties": {"zone": {"type": "string"}}}}
# What the "tool-call" script's two calls are as Anthropic tool_use blocks.
TOOL_USES = [
    {"type": "tool_use", "id": "toolu_0", "name": "get_weather", "input": {"city": "Paris"}},
    {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"zone": "CET"}},
]


def body(content: Any = "hello", **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 16,
            "messages": [{"role": "user", "content": content}], **fields}


def assert_anthropic_error(data: dict[str, Any], kind: str) -> str:
    assert set(data) == {"type", "error"} and data["type"] == "error"
    assert set(data["error"]) == {"type", "message"}
    assert data["error"]["type"] == kind
    assert isinstance(data["error"]["message"], str) and data["error"]["message"]
    return data["error"]["message"]


# --- the answer ----------------------------------------------------------------------------


async def test_message_has_anthropic_shape_and_usage(client: TestClient) -> None:
    resp = await client.post(MESSAGES, json=body())
    assert resp.status == 200
    data = await resp.json()
    assert data["id"].startswith("msg_")
    assert data == {
        "id": data["id"],
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": [{"type": "text", "text": "Hello world"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        # Anthropic counts cache reads apart: 5 prompt tokens, 2 of them from the cache.
        "usage": {"input_tokens": 3, "output_tokens": 4, "cache_read_input_tokens": 2,
                  "cache_creation_input_tokens": 0},
    }


@pytest.mark.parametrize(
    ("script", "stop_reason", "stop_sequence"),
    [("hello", "end_turn", None), ("stop-string", "stop_sequence", STOP),
     ("length", "max_tokens", None)],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_stop_reason_tells_end_turn_stop_sequence_and_max_tokens_apart(
    client: TestClient, script: str, stop_reason: str, stop_sequence: str | None, stream: bool
) -> None:
    resp = await client.post(MESSAGES, json=body(script, stop_sequences=[STOP], stream=stream))
    assert resp.status == 200
    if stream:
        events = parse_named_sse(await resp.text())
        delta = next(data for name, data in events if name == "message_delta")["delta"]
    else:
        delta = await resp.json()
    assert (delta["stop_reason"], delta["stop_sequence"]) == (stop_reason, stop_sequence)


async def test_messages_request_becomes_the_chat_an_openai_client_would_send(
    client: TestClient, scripted: Scripted
) -> None:
    tool = {"name": "weather", "description": "Weather in a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
    resp = await client.post(MESSAGES, json={
        "model": MODEL,
        "max_tokens": 12,
        "system": [{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "x"},
                {"type": "text", "text": "let me look"},
                {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Paris"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1",
                 "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "and tomorrow?"},
            ]},
            {"role": "assistant", "content": "rain"},
            {"role": "user", "content": "hello"},
        ],
        "tools": [tool],
        "tool_choice": {"type": "auto"},
        "temperature": 0.5, "top_p": 0.9, "top_k": 40, "stop_sequences": ["X", "Y"],
        "metadata": {"user_id": "ignored"},
        "some_future_field": True,
    })
    assert resp.status == 200, await resp.text()
    msg = scripted.seen[-1]
    assert isinstance(msg, AdmitChat)
    assert msg.messages == [
        {"role": "system", "content": "be\nbrief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "let me look", "tool_calls": [
            {"id": "t1", "type": "function",
             "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        {"role": "user", "content": "and tomorrow?"},
        {"role": "assistant", "content": "rain"},
        {"role": "user", "content": "hello"},
    ]
    assert msg.tools == [{"type": "function", "function": {
        "name": "weather", "description": "Weather in a city",
        "parameters": tool["input_schema"]}}]
    s = msg.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.stop) == (12, 0.5, 0.9, 40,
                                                                       ["X", "Y"])


async def test_unsent_sampling_fields_keep_defaults_and_tool_choice_none_hides_tools(
    client: TestClient, scripted: Scripted
) -> None:
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    resp = await client.post(MESSAGES, json=body(system="sys", tools=tools,
                                                 tool_choice={"type": "none"}))
    assert resp.status == 200
    msg = scripted.seen[-1]
    assert msg.tools is None
    assert msg.messages[0] == {"role": "system", "content": "sys"}
    assert (msg.sampling.temperature, msg.sampling.top_p, msg.sampling.top_k) == (1.0, 1.0, 0)


async def test_stream_sends_anthropic_events_in_order(client: TestClient) -> None:
    resp = await client.post(MESSAGES, json=body(stream=True))
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "text/event-stream"
    events = parse_named_sse(await resp.text())
    names = [name for name, _ in events]
    # The text block opens with its first text, so after the ping (no block is open early).
    assert names == ["message_start", "ping", "content_block_start",
                     *["content_block_delta"] * len(DELTAS),
                     "content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_") and start["model"] == MODEL
    assert (start["role"], start["content"], start["stop_reason"]) == ("assistant", [], None)
    assert start["usage"] == {"input_tokens": 3, "output_tokens": 0,
                              "cache_read_input_tokens": 2, "cache_creation_input_tokens": 0}
    assert events[2][1] == {"type": "content_block_start", "index": 0,
                            "content_block": {"type": "text", "text": ""}}
    assert [data for name, data in events if name == "content_block_delta"] == [
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": d}}
        for d in DELTAS
    ]
    assert events[-3][1] == {"type": "content_block_stop", "index": 0}
    assert events[-2][1] == {"type": "message_delta",
                             "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                             "usage": {"output_tokens": 4}}


async def test_failure_after_start_is_an_error_event_in_anthropic_shape(
    client: TestClient,
) -> None:
    resp = await client.post(MESSAGES, json=body("fail-mid-stream", stream=True))
    assert resp.status == 200
    events = parse_named_sse(await resp.text())
    assert events[3][1]["delta"]["text"] == "partial"
    name, data = events[-1]
    assert name == "error"
    assert assert_anthropic_error(data, "overloaded_error") == "Out of memory during decode."
    resp = await client.post(MESSAGES, json=body("fail-mid-stream"))
    assert resp.status == 503
    assert_anthropic_error(await resp.json(), "overloaded_error")


@pytest.mark.parametrize("stream", [False, True])
async def test_refusal_before_start_is_a_plain_anthropic_error_not_a_stream(
    client: TestClient, stream: bool
) -> None:
    resp = await client.post(MESSAGES, json=body("refuse-before-start", stream=stream))
    assert resp.status == 429
    assert resp.headers["Content-Type"].startswith("application/json")
    assert_anthropic_error(await resp.json(), "rate_limit_error")
    busy = body(stream=stream)
    busy["model"] = BUSY_MODEL
    resp = await client.post(MESSAGES, json=busy)
    assert resp.status == 429 and resp.headers["Retry-After"] == "3"
    assert_anthropic_error(await resp.json(), "rate_limit_error")


# --- errors --------------------------------------------------------------------------------

BAD = [
    pytest.param({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                 id="missing-max-tokens"),
    pytest.param(body(temperature=1.5), id="temperature-above-1"),
    pytest.param(body(top_k=-1), id="top-k-negative"),
    pytest.param({**body(), "messages": []}, id="no-messages"),
    pytest.param({**body(), "messages": [{"role": "system", "content": "hi"}]}, id="system-role"),
    pytest.param(body([{"type": "image", "source": {"type": "base64", "data": "..."}}]),
                 id="image-block-not-base64"),
    pytest.param(body([{"type": "document", "source": {"type": "text", "data": "x"}}]),
                 id="document-block"),
    pytest.param(body([{"type": "text"}]), id="text-block-without-text"),
    pytest.param(body(stop_sequences=[""]), id="empty-stop-sequence"),
    pytest.param(body(tools=[{"name": "web", "type": "web_search_20250305"}]), id="server-tool"),
    pytest.param(body(system=[{"type": "image"}]), id="image-in-system"),
    pytest.param(body(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}),
                 id="tool-choice-unknown-tool"),
    pytest.param(body(tools=[WEATHER], tool_choice={"type": "tool"}),
                 id="tool-choice-without-name"),
    pytest.param(body(tool_choice={"type": "any"}), id="tool-choice-any-without-tools"),
    pytest.param(body(tool_choice={"type": "maybe"}), id="tool-choice-unknown-type"),
    pytest.param(body(tools=WEATHER), id="tools-not-a-list"),
    pytest.param(body(tools=[{"name": "f"}]), id="tool-without-input-schema"),
    pytest.param(body(tools=[WEATHER, WEATHER]), id="duplicate-tool-names"),
    pytest.param(body(thinking={"type": "enabled", "budget_tokens": 16}),
                 id="budget-equal-to-max-tokens"),
    pytest.param(body(thinking={"type": "enabled", "budget_tokens": 0}), id="budget-zero"),
    pytest.param(body(thinking={"type": "enabled"}), id="enabled-without-budget"),
    pytest.param(body(thinking={"type": "sometimes"}), id="thinking-unknown-type"),
    pytest.param(body(output_format={"type": "json_schema"}), id="output-format-no-schema"),
]


@pytest.mark.parametrize("payload", BAD)
async def test_bad_request_is_invalid_request_error_in_anthropic_shape(
    client: TestClient, scripted: Scripted, payload: dict[str, Any]
) -> None:
    resp = await client.post(MESSAGES, json=payload)
    assert resp.status == 400
    assert_anthropic_error(await resp.json(), "invalid_request_error")
    assert not [m for m in scripted.seen if isinstance(m, AdmitChat)]  # refused before admission


async def test_stop_sequences_over_their_count_or_size_are_a_400_naming_the_limit(
    client: TestClient, scripted: Scripted
) -> None:
    # As many as allowed, of the size allowed (32 characters each).
    at_the_limits = [f"{i:0{MAX_STOP_CHARS // MAX_STOPS}d}" for i in range(MAX_STOPS)]
    resp = await client.post(MESSAGES, json=body(stop_sequences=at_the_limits))
    assert resp.status == 200, await resp.text()
    admitted = [m for m in scripted.seen if isinstance(m, AdmitChat)]
    assert admitted[-1].sampling.stop == at_the_limits
    for stops, limit in ((["x"] * (MAX_STOPS + 1), MAX_STOPS),
                         ([*at_the_limits[:-1], at_the_limits[-1] + "x"], MAX_STOP_CHARS)):
        resp = await client.post(MESSAGES, json=body(stop_sequences=stops))
        assert resp.status == 400
        message = assert_anthropic_error(await resp.json(), "invalid_request_error")
        assert "'stop_sequences'" in message and f"the limit is {limit}" in message
    assert [m for m in scripted.seen if isinstance(m, AdmitChat)] == admitted


async def test_malformed_json_is_invalid_request_error(client: TestClient) -> None:
    resp = await client.post(MESSAGES, data=b"{", headers={"Content-Type": "application/json"})
    assert resp.status == 400
    assert_anthropic_error(await resp.json(), "invalid_request_error")


@pytest.mark.parametrize(
    ("method", "path", "payload", "status", "kind"),
    [
        ("POST", MESSAGES, {**body(), "model": "nope"}, 404, "not_found_error"),
        ("POST", "/v1/messages/nothing-here", {}, 404, "not_found_error"),
        ("GET", MESSAGES, None, 405, "invalid_request_error"),
        ("POST", MESSAGES, body("x" * 5000), 413, "request_too_large"),
        ("POST", MESSAGES, body("crash-admission"), 500, "api_error"),
    ],
)
async def test_errors_on_messages_routes_use_anthropic_shape_and_status(
    client: TestClient, method: str, path: str, payload: Any, status: int, kind: str
) -> None:
    resp = await client.request(method, path, json=payload)
    assert resp.status == status
    message = assert_anthropic_error(await resp.json(), kind)
    assert "admission bug" not in message  # internals stay in the log


async def test_other_routes_keep_openai_error_shape(client: TestClient) -> None:
    resp = await client.post("/v1/chat/completions", json={**body(), "model": "nope"})
    assert resp.status == 404
    assert set((await resp.json())["error"]) == {"message", "type", "param", "code"}


async def test_count_tokens_returns_input_tokens_from_admission(
    client: TestClient, scripted: Scripted
) -> None:
    resp = await client.post(COUNT, json={
        "model": MODEL, "system": "sys", "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
    })
    assert resp.status == 200
    assert await resp.json() == {"input_tokens": 201}  # the script: 100 per message + tools
    msg = scripted.seen[-1]
    assert isinstance(msg, CountTokens)
    assert msg.messages == [{"role": "system", "content": "sys"},
                            {"role": "user", "content": "hi"}]
    resp = await client.post(COUNT, json={"model": "nope", "messages": [
        {"role": "user", "content": "hi"}]})
    assert resp.status == 404
    assert_anthropic_error(await resp.json(), "not_found_error")


async def test_missing_api_key_on_messages_is_authentication_error(
    aiohttp_client: Any, scripted: Scripted
) -> None:
    app = scripted.app(api_key="sekret")
    client = await aiohttp_client(app)
    for headers in ({}, {"x-api-key": "wrong"}):
        resp = await client.post(MESSAGES, json=body(), headers=headers)
        assert resp.status == 401
        assert_anthropic_error(await resp.json(), "authentication_error")
    resp = await client.post(MESSAGES, json=body(), headers={"x-api-key": "sekret"})
    assert resp.status == 200


async def test_bad_requests_leave_the_server_serving(client: TestClient) -> None:
    for payload in (body(tools={"name": "f"}),
                    body(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}),
                    body(max_tokens=8, thinking={"type": "enabled", "budget_tokens": 9})):
        resp = await client.post(MESSAGES, json=payload)
        assert resp.status == 400
        assert_anthropic_error(await resp.json(), "invalid_request_error")
    resp = await client.post(MESSAGES, json=body())
    assert resp.status == 200
    assert (await resp.json())["content"] == [{"type": "text", "text": "Hello world"}]


# --- tools and thinking --------------------------------------------------------------------


async def test_tool_calls_are_tool_use_blocks_after_the_text(client: TestClient) -> None:
    resp = await client.post(MESSAGES, json=body("tool-call", tools=[WEATHER, CLOCK]))
    assert resp.status == 200
    data = await resp.json()
    assert data["content"] == [{"type": "text", "text": TOOL_TEXT}, *TOOL_USES]
    assert (data["stop_reason"], data["stop_sequence"]) == ("tool_use", None)
    assert data["usage"]["output_tokens"] == 6


async def test_streamed_tool_calls_are_blocks_with_input_json_deltas(client: TestClient) -> None:
    resp = await client.post(MESSAGES, json=body("tool-call", tools=[WEATHER, CLOCK],
                                                 stream=True))
    assert resp.status == 200
    events = parse_named_sse(await resp.text())
    assert [data for _, data in events[2:]] == [
        {"type": "content_block_start", "index": 0,
         "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "text_delta", "text": TOOL_TEXT}},
        {"type": "content_block_stop", "index": 0},
        *[event for i, (use, call) in enumerate(zip(TOOL_USES, TOOL_CALLS, strict=True), 1)
          for event in (
              {"type": "content_block_start", "index": i,
               "content_block": {**use, "input": {}}},
              {"type": "content_block_delta", "index": i,
               "delta": {"type": "input_json_delta", "partial_json": call.arguments}},
              {"type": "content_block_stop", "index": i},
          )],
        {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
         "usage": {"output_tokens": 6}},
        {"type": "message_stop"},
    ]


async def test_reasoning_is_a_thinking_block_before_the_text(client: TestClient) -> None:
    resp = await client.post(MESSAGES, json=body("reasoning"))
    assert resp.status == 200
    data = await resp.json()
    assert data["content"] == [
        {"type": "thinking", "thinking": "".join(REASONING), "signature": ""},
        {"type": "text", "text": "".join(DELTAS)},
    ]
    assert data["stop_reason"] == "end_turn"
    # Anthropic counts thinking in output_tokens: reasoning, text and the end token.
    assert data["usage"]["output_tokens"] == len(REASONING) + len(DELTAS) + 1


async def test_streamed_reasoning_is_a_thinking_block_then_a_text_block(
    client: TestClient,
) -> None:
    resp = await client.post(MESSAGES, json=body("reasoning", stream=True))
    assert resp.status == 200
    events = parse_named_sse(await resp.text())
    assert [data for _, data in events[2:-2]] == [
        {"type": "content_block_start", "index": 0,
         "content_block": {"type": "thinking", "thinking": "", "signature": ""}},
        *[{"type": "content_block_delta", "index": 0,
           "delta": {"type": "thinking_delta", "thinking": thought}} for thought in REASONING],
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "signature_delta", "signature": ""}},
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1,
         "content_block": {"type": "text", "text": ""}},
        *[{"type": "content_block_delta", "index": 1,
           "delta": {"type": "text_delta", "text": text}} for text in DELTAS],
        {"type": "content_block_stop", "index": 1},
    ]
    assert events[-2][1]["delta"]["stop_reason"] == "end_turn"


def _renderer() -> MessagesRenderer:
    req = MessagesRequest(model=MODEL, max_tokens=8, messages=[])
    msg = AdmitChat(request_id="msg_1", model=MODEL, messages=[],
                    sampling=SamplingParams(max_tokens=8))
    return MessagesRenderer(req, msg, Admitted(request_id="msg_1", model=MODEL, prompt_tokens=5))


def _frames(renderer: MessagesRenderer, deltas: list[TokensGenerated],
            finished: RequestFinished) -> list[dict[str, Any]]:
    frames = [*renderer.opening(finished)]
    for delta in deltas:
        frames += renderer.delta(delta)
    frames += renderer.closing(finished)
    return [json.loads(data) for _, data in frames]


def test_tool_only_answer_has_no_text_block_and_an_empty_answer_has_one() -> None:
    call = ToolCall(index=0, id="call_abc", name="get_weather", arguments="")
    tool_only = [TokensGenerated(request_id="msg_1", text="", token_ids=[1], tool_calls=[call])]
    finished = RequestFinished(request_id="msg_1", finish_reason="tool_calls",
                               usage=Usage(prompt_tokens=5, completion_tokens=2))
    use = {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {}}
    whole = json.loads(_renderer().whole(tool_only, finished))
    assert (whole["content"], whole["stop_reason"]) == ([use], "tool_use")
    blocks = [e for e in _frames(_renderer(), tool_only, finished)
              if e["type"] == "content_block_start"]
    assert blocks == [{"type": "content_block_start", "index": 0, "content_block": use}]

    empty = RequestFinished(request_id="msg_1", finish_reason="stop",
                            usage=Usage(prompt_tokens=5, completion_tokens=1))
    whole = json.loads(_renderer().whole([], empty))
    assert whole["content"] == [{"type": "text", "text": ""}]
    assert [e["type"] for e in _frames(_renderer(), [], empty)] == [
        "message_start", "ping", "content_block_start", "content_block_stop",
        "message_delta", "message_stop"]


def test_tool_call_arguments_that_are_not_an_object_become_an_empty_input() -> None:
    call = ToolCall(index=0, id="call_x", name="f", arguments="[1, 2")
    deltas = [TokensGenerated(request_id="msg_1", text="", token_ids=[1], tool_calls=[call])]
    finished = RequestFinished(request_id="msg_1", finish_reason="tool_calls",
                               usage=Usage(prompt_tokens=5, completion_tokens=1))
    assert json.loads(_renderer().whole(deltas, finished))["content"][0]["input"] == {}
    partial = [e["delta"]["partial_json"] for e in _frames(_renderer(), deltas, finished)
               if e["type"] == "content_block_delta"]
    assert partial == ["{}"]  # valid JSON, so the client's accumulator can parse it


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        (None, ToolChoice()),
        ({"type": "auto"}, ToolChoice(mode="auto")),
        ({"type": "any"}, ToolChoice(mode="required")),
        ({"type": "tool", "name": "get_time"}, ToolChoice(mode="function", name="get_time")),
        ({"type": "none"}, ToolChoice(mode="none")),
        ({"type": "auto", "disable_parallel_tool_use": True},
         ToolChoice(mode="auto", parallel=False)),
        ({"type": "any", "disable_parallel_tool_use": False}, ToolChoice(mode="required")),
        ({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
         ToolChoice(mode="function", name="get_weather", parallel=False)),
    ],
)
async def test_tool_choice_becomes_the_neutral_tool_choice(
    client: TestClient, scripted: Scripted, choice: dict[str, Any] | None, expected: ToolChoice
) -> None:
    fields: dict[str, Any] = {"tools": [WEATHER, CLOCK]}
    if choice is not None:
        fields["tool_choice"] = choice
    resp = await client.post(MESSAGES, json=body(**fields))
    assert resp.status == 200, await resp.text()
    msg = scripted.seen[-1]
    assert isinstance(msg, AdmitChat)
    assert msg.tool_choice == expected
    # "none" hides the tools from the template; every other choice shows them all.
    names = [tool["function"]["name"] for tool in msg.tools or []]
    assert names == ([] if expected.mode == "none" else ["get_weather", "get_time"])


@pytest.mark.parametrize(
    ("thinking", "template_kwargs", "budget"),
    [
        (None, None, None),
        ({"type": "enabled", "budget_tokens": 1024}, {"enable_thinking": True}, 1024),
        # Below Anthropic's minimum of 1024: a local model may think usefully in fewer.
        ({"type": "enabled", "budget_tokens": 1}, {"enable_thinking": True}, 1),
        ({"type": "enabled", "budget_tokens": 1999}, {"enable_thinking": True}, 1999),
        ({"type": "disabled"}, {"enable_thinking": False}, None),
        ({"type": "adaptive"}, {"enable_thinking": True}, None),
    ],
)
async def test_thinking_sets_the_template_switch_and_the_budget(
    client: TestClient, scripted: Scripted, thinking: dict[str, Any] | None,
    template_kwargs: dict[str, Any] | None, budget: int | None,
) -> None:
    fields: dict[str, Any] = {"max_tokens": 2000}
    if thinking is not None:
        fields["thinking"] = thinking
    resp = await client.post(MESSAGES, json=body(**fields))
    assert resp.status == 200, await resp.text()
    msg = scripted.seen[-1]
    assert isinstance(msg, AdmitChat)
    assert (msg.chat_template_kwargs, msg.thinking_budget) == (template_kwargs, budget)
    assert msg.response_format is None


@pytest.mark.parametrize("field", ["output_format", "output_config"])
async def test_json_schema_output_format_becomes_the_response_format(
    client: TestClient, scripted: Scripted, field: str
) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "schema": schema}
    value = fmt if field == "output_format" else {"format": fmt, "effort": "low"}
    resp = await client.post(MESSAGES, json=body(**{field: value}))
    assert resp.status == 200, await resp.text()
    msg = scripted.seen[-1]
    assert isinstance(msg, AdmitChat)
    assert msg.response_format == OutputFormat(type="json_schema", schema=schema)


async def test_agent_loop_maps_tool_use_ids_back_to_the_engines_call_ids(
    client: TestClient, scripted: Scripted
) -> None:
    first = await client.post(MESSAGES, json=body("tool-call", tools=[WEATHER, CLOCK]))
    answer = (await first.json())["content"]
    resp = await client.post(MESSAGES, json=body(tools=[WEATHER, CLOCK], messages=[
        {"role": "user", "content": "tool-call"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_0", "content": "18C"},
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "14:00"}], "is_error": False},
        ]},
    ]))
    assert resp.status == 200, await resp.text()
    msg = scripted.seen[-1]
    assert isinstance(msg, AdmitChat)
    # The prompt is the one an OpenAI client would send back with the engine's call ids.
    assert msg.messages == [
        {"role": "user", "content": "tool-call"},
        {"role": "assistant", "content": TOOL_TEXT, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": json.loads(call.arguments)}}
            for call in TOOL_CALLS]},
        {"role": "tool", "tool_call_id": "call_0", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_1", "content": "14:00"},
    ]


# --- the official anthropic client ---------------------------------------------------------


async def test_anthropic_client_create_stream_and_errors_on_scripted_server(
    scripted: Scripted,
) -> None:
    server = await scripted.start(api_key="sekret")
    client = anthropic.AsyncAnthropic(base_url=server.url, api_key="sekret", max_retries=0)
    try:
        message = await client.messages.create(
            model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hello"}]
        )
        assert message.content[0].text == "Hello world"
        assert message.stop_reason == "end_turn"
        assert (message.usage.input_tokens, message.usage.output_tokens) == (3, 4)
        async with client.messages.stream(
            model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "stop-string"}],
            stop_sequences=[STOP],
        ) as stream:
            text = "".join([chunk async for chunk in stream.text_stream])
            final = await stream.get_final_message()
        assert text == "Hello world" == final.content[0].text
        assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", STOP)
        assert final.usage.output_tokens == 3
        with pytest.raises(anthropic.APIStatusError) as caught:
            async with client.messages.stream(
                model=MODEL, max_tokens=5,
                messages=[{"role": "user", "content": "fail-mid-stream"}],
            ) as stream:
                await stream.get_final_message()
        assert "Out of memory during decode." in str(caught.value)
        with pytest.raises(anthropic.NotFoundError):
            await client.messages.create(
                model="nope", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
            )
        count = await client.messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        )
        assert count.input_tokens == 100
        stranger = anthropic.AsyncAnthropic(base_url=server.url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError):
            await stranger.messages.create(
                model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}]
            )
        await stranger.close()
    finally:
        await client.close()
        await server.close()


async def test_anthropic_client_tool_use_and_thinking_on_scripted_server(
    scripted: Scripted,
) -> None:
    server = await scripted.start()
    client = anthropic.AsyncAnthropic(base_url=server.url, api_key="x", max_retries=0)
    tools: Any = [WEATHER, CLOCK]
    ask: Any = {"model": MODEL, "max_tokens": 64, "tools": tools,
                "messages": [{"role": "user", "content": "tool-call"}]}
    try:
        message = await client.messages.create(
            **ask, tool_choice={"type": "any", "disable_parallel_tool_use": False}
        )
        assert scripted.seen[-1].tool_choice == ToolChoice(mode="required")
        async with client.messages.stream(**ask) as stream:
            final = await stream.get_final_message()
        for answer in (message, final):
            assert answer.stop_reason == "tool_use"
            assert [block.type for block in answer.content] == ["text", "tool_use", "tool_use"]
            assert answer.content[0].text == TOOL_TEXT
            assert [block.model_dump(include={"type", "id", "name", "input"})
                    for block in answer.content[1:]] == TOOL_USES

        # The agent loop: the answer goes back as it came, each call with its result.
        results: Any = [{"type": "tool_result", "tool_use_id": block.id, "content": "ok"}
                        for block in final.content if block.type == "tool_use"]
        after = await client.messages.create(**{**ask, "messages": [
            *ask["messages"], {"role": "assistant", "content": final.content},
            {"role": "user", "content": results}]})
        assert after.content[0].text == "Hello world"
        seen = scripted.seen[-1].messages
        assert [m.get("tool_call_id") for m in seen[-2:]] == ["call_0", "call_1"]
        assert [c["id"] for c in seen[-3]["tool_calls"]] == ["call_0", "call_1"]

        thinking: Any = {"type": "enabled", "budget_tokens": 32}
        think: Any = {"model": MODEL, "max_tokens": 64, "thinking": thinking,
                      "messages": [{"role": "user", "content": "reasoning"}]}
        message = await client.messages.create(**think)
        msg = scripted.seen[-1]
        assert (msg.thinking_budget, msg.chat_template_kwargs) == (32, {"enable_thinking": True})
        async with client.messages.stream(**think) as stream:
            thoughts = [event.thinking async for event in stream if event.type == "thinking"]
            final = await stream.get_final_message()
        assert thoughts == REASONING
        for answer in (message, final):
            assert [block.type for block in answer.content] == ["thinking", "text"]
            assert answer.content[0].thinking == "".join(REASONING)
            assert answer.content[1].text == "".join(DELTAS)
            assert answer.stop_reason == "end_turn"

        with pytest.raises(anthropic.BadRequestError) as caught:
            await client.messages.create(**ask, tool_choice={"type": "tool", "name": "nope"})
        assert caught.value.body["error"]["type"] == "invalid_request_error"
        with pytest.raises(anthropic.BadRequestError):
            await client.messages.create(**{**think, "max_tokens": 32})
        message = await client.messages.create(  # still serving
            model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hello"}]
        )
        assert message.content[0].text == "Hello world"
    finally:
        await client.close()
        await server.close()


# The client no longer has sampling parameters; the server still reads them from the body.
GREEDY = {"temperature": 0}
CONVERSATION = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "The quick brown fox"},
]


async def test_anthropic_client_greedy_answer_equals_openai_route_on_real_stack(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TROUPE_HOME", str(tmp_path))
    async with real_stack(tiny_model_dir) as stack:
        oai = openai.AsyncOpenAI(base_url=f"{stack.server.url}/v1", api_key="x", max_retries=0)
        ant = anthropic.AsyncAnthropic(base_url=stack.server.url, api_key="x", max_retries=0)
        try:
            reference = await oai.chat.completions.create(
                model=stack.model, temperature=0, max_tokens=24,
                messages=[{"role": "system", "content": "Answer briefly."}, *CONVERSATION],
            )
            expected = reference.choices[0].message.content
            assert expected  # the tiny model says something in 24 tokens
            # The system prompt as a string, then as text blocks; content as a block list.
            blocks = [{**m, "content": [{"type": "text", "text": m["content"]}]}
                      for m in CONVERSATION]
            message = await ant.messages.create(
                model=stack.model, max_tokens=24, system="Answer briefly.",
                messages=CONVERSATION, extra_body=GREEDY,
            )
            assert message.content[0].text == expected
            assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[
                reference.choices[0].finish_reason]
            assert message.usage.output_tokens == reference.usage.completion_tokens
            assert (message.usage.input_tokens + message.usage.cache_read_input_tokens
                    == reference.usage.prompt_tokens)
            async with ant.messages.stream(
                model=stack.model, max_tokens=24, extra_body=GREEDY,
                system=[{"type": "text", "text": "Answer briefly."}], messages=blocks,
            ) as stream:
                streamed = "".join([chunk async for chunk in stream.text_stream])
                final = await stream.get_final_message()
            assert streamed == expected == final.content[0].text
            count = await ant.messages.count_tokens(
                model=stack.model, system="Answer briefly.", messages=CONVERSATION
            )
            template = [{"role": "system", "content": "Answer briefly."}, *CONVERSATION]
            tokenizer = load_tokenizer(Path(stack.model_path))
            assert count.input_tokens == len(
                tokenizer.apply_chat_template(template, add_generation_prompt=False)
            )
        finally:
            await oai.close()
            await ant.close()


async def test_stop_sequence_on_real_stack_is_reported_and_cut(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TROUPE_HOME", str(tmp_path))
    async with real_stack(tiny_model_dir) as stack:
        ant = anthropic.AsyncAnthropic(base_url=stack.server.url, api_key="x", max_retries=0)
        try:
            ask = {"model": stack.model, "max_tokens": 40, "extra_body": GREEDY,
                   "messages": [{"role": "user", "content": "The quick brown fox"}]}
            free = await ant.messages.create(**ask)
            text = free.content[0].text
            # A stop sequence taken from the middle of the free answer must cut it there.
            stop = text[len(text) // 2:len(text) // 2 + 2]
            assert len(stop) == 2, json.dumps(text)
            cut = await ant.messages.create(**ask, stop_sequences=[stop])
            assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
            assert cut.content[0].text == text[: text.index(stop)]
        finally:
            await ant.close()


# --- Claude Code's requests: its model names, and a max_tokens past the context ---------------


async def test_claude_codes_request_is_served_with_max_tokens_cut_to_the_room_left(
    tiny_short_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TROUPE_HOME", str(tmp_path))
    async with real_stack(tiny_short_dir) as stack:  # a 64-token context
        ant = anthropic.AsyncAnthropic(base_url=stack.server.url, api_key="x", max_retries=0)
        try:
            # Streamed, as Claude Code asks (the client refuses 32000 tokens unstreamed).
            async with ant.messages.stream(
                model="claude-sonnet-4-6", max_tokens=32000,
                thinking={"type": "enabled", "budget_tokens": 31999},
                messages=[{"role": "user", "content": "The quick brown fox"}],
                extra_body=GREEDY,
            ) as stream:
                message = await stream.get_final_message()
            assert message.model == stack.model == "tiny-short"
            assert message.stop_reason == "max_tokens"
            usage = message.usage
            assert usage.input_tokens + usage.cache_read_input_tokens + usage.output_tokens == 64
            count = await ant.messages.count_tokens(
                model="claude-haiku-4-5-20251001",
                messages=[{"role": "user", "content": "The quick brown fox"}])
            assert 0 < count.input_tokens < 64
        finally:
            await ant.close()


class Recorder(Actor):
    """A scheduler that records each request it is sent and finishes it at once."""

    def __init__(self) -> None:
        self.added: list[AddRequest] = []

    async def handle(self, msg: Any) -> Any:
        assert isinstance(msg, AddRequest)
        self.added.append(msg)
        reply = self.take_reply()
        reply.send(RequestFinished(request_id=msg.request_id, finish_reason="length",
                                   usage=Usage(prompt_tokens=len(msg.prompt_tokens),
                                               completion_tokens=0)))
        reply.close()


@pytest.fixture(scope="module")
def thinking_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama's files with <think> and </think> in its tokenizer (mlx-lm reads them as
    its reasoning tags): for admission only, which never runs the model."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("thinking") / "thinking"
    shutil.copytree(tiny_model_dir, out)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    tok.save_pretrained(str(out))
    return out


@pytest.mark.parametrize(
    ("max_tokens", "budget", "cut"),
    [
        (32000, 31999, "both"),  # Claude Code's: max_tokens cut to the room, the budget below it
        (32000, 10, "max_tokens"),  # a budget that fits the room is kept
        (20, 10, None),  # within the room: nothing is cut
    ],
)
async def test_a_thinking_budget_is_kept_below_the_cut_max_tokens(
    aiohttp_client: Any, thinking_model_dir: Path, max_tokens: int, budget: int,
    cut: str | None,
) -> None:
    async with ActorSystem() as system:
        scheduler = await system.spawn(Recorder, name="scheduler")
        card = ModelCard(id="thinking", context_length=64, source="local",
                         path=str(thinking_model_dir))
        admission = await system.spawn(Admission, name="admission", thread="admission",
                                       models=[(card, scheduler)], pool=None)
        client = await aiohttp_client(create_app(system=system, admission=admission,
                                                 config=ServeConfig()))
        resp = await client.post(MESSAGES, json=body(
            "The quick brown fox", model="claude-opus-4-1", max_tokens=max_tokens,
            thinking={"type": "enabled", "budget_tokens": budget}))
        data = await resp.json()
        assert resp.status == 200, data
        assert (data["model"], data["stop_reason"]) == ("thinking", "max_tokens")
        [request] = scheduler._cell.instance.added  # type: ignore[attr-defined]
        room = 64 - len(request.prompt_tokens)
        assert request.output is not None and request.output.think == ("<think>", "</think>")
        expected = {"both": (room, room - 1), "max_tokens": (room, budget),
                    None: (max_tokens, budget)}[cut]
        assert (request.sampling.max_tokens, request.output.thinking_budget) == expected
        await client.close()
