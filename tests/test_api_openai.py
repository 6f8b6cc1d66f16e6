"""The OpenAI HTTP layer, against a real ActorSystem and a scripted admission actor.

No model here: ``ScriptedAdmission`` (tests/http_stack.py) answers like the real admission
actor (404 for unknown models, a ticket whose events a script plays), and the prompt text picks
the script. The real engine is tested elsewhere.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import http_stack
import openai
import pytest
from aiohttp.test_utils import TestClient
from http_stack import (
    BUSY_MODEL,
    DELTAS,
    ENDLESS,
    MAX_BODY,
    MODEL,
    REASONING,
    TOOL_CALLS,
    TOOL_TEXT,
    Scripted,
    parse_data_sse,
)

from troupe.actors.messages import AdmitChat, AdmitCompletion, OutputFormat
from troupe.api.stops import MAX_STOP_CHARS

# --- fixtures and helpers ------------------------------------------------------------------

# The scripted stack's fixtures, bound here by name so that pytest finds them.
scripted, client, openai_client = http_stack.scripted, http_stack.client, http_stack.openai_client


def chat_body(content: str = "hello", **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


async def read_sse(resp: Any) -> list[dict[str, Any]]:
    """Parse an SSE body exactly: ``data: <json>`` events only, ``data: [DONE]`` last."""
    assert resp.headers["Content-Type"] == "text/event-stream"
    assert resp.headers["Cache-Control"] == "no-cache"
    return parse_data_sse((await resp.read()).decode())


def assert_error_shape(body: dict[str, Any], *, param: str | None = None) -> dict[str, Any]:
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] == param
    return error


async def assert_still_serving(client: TestClient) -> None:
    resp = await client.post("/v1/chat/completions", json=chat_body())
    assert resp.status == 200
    assert (await resp.json())["choices"][0]["message"]["content"] == "Hello world"


# --- chat completions ----------------------------------------------------------------------


async def test_chat_completion_has_openai_shape_and_usage(client: TestClient) -> None:
    resp = await client.post("/v1/chat/completions", json=chat_body())
    assert resp.status == 200
    body = await resp.json()
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert isinstance(body["created"], int)
    assert body["model"] == MODEL
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello world"},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert body["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 4,  # the 3 deltas and the end-of-sequence token
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 2},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


async def test_chat_response_id_is_the_admitted_request_id(
    client: TestClient, scripted: Scripted
) -> None:
    body = await (await client.post("/v1/chat/completions", json=chat_body())).json()
    assert scripted.seen[-1].request_id == body["id"]


async def test_chat_fields_become_sampling_params(client: TestClient, scripted: Scripted) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    resp = await client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
                {"role": "tool", "content": "42", "tool_call_id": "1"},
                {"role": "user", "content": "hello"},
            ],
            "max_tokens": 10,
            "max_completion_tokens": 20,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 40,
            "min_p": 0.05,
            "seed": 7,
            "stop": "END",
            "stop_token_ids": [2, 3],
            "repetition_penalty": 1.1,
            "presence_penalty": -1.5,
            "frequency_penalty": 2,
            "logprobs": True,
            "top_logprobs": 3,
            "tools": tools,
            "tool_choice": "auto",
            "chat_template_kwargs": {"enable_thinking": False},
            "response_format": {"type": "text"},
            "user": "ignored",
            "parallel_tool_calls": True,
            "some_future_field": {"x": 1},
        },
    )
    assert resp.status == 200, await resp.text()
    msg = scripted.seen[-1]
    assert isinstance(msg, AdmitChat)
    assert msg.model == MODEL
    assert msg.messages == [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]},
        {"role": "tool", "content": "42", "tool_call_id": "1"},
        {"role": "user", "content": "hello"},
    ]
    assert msg.tools == tools
    assert msg.chat_template_kwargs == {"enable_thinking": False}
    s = msg.sampling
    assert s.max_tokens == 20  # max_completion_tokens wins over the deprecated max_tokens
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.0, 0.5, 40, 0.05, 7)
    assert s.stop == ["END"] and s.stop_token_ids == [2, 3]
    assert s.repetition_penalty == 1.1
    assert (s.presence_penalty, s.frequency_penalty) == (-1.5, 2.0)
    assert (s.logprobs, s.top_logprobs) == (True, 3)


async def test_chat_unsent_fields_keep_defaults_and_null_means_unsent(
    client: TestClient, scripted: Scripted
) -> None:
    resp = await client.post(
        "/v1/chat/completions",
        json=chat_body(temperature=None, stop=None, tools=None, stream=None, seed=None),
    )
    assert resp.status == 200
    s = scripted.seen[-1].sampling
    assert s.max_tokens == 77  # ServeConfig.default_max_tokens
    assert (s.temperature, s.top_p, s.stop, s.seed, s.logprobs) == (1.0, 1.0, [], None, False)


@pytest.mark.parametrize(
    ("sent", "mode", "name", "parallel"),
    [
        ({}, "auto", None, True),
        ({"tool_choice": "none"}, "none", None, True),
        ({"tool_choice": "required", "parallel_tool_calls": False}, "required", None, False),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "function", "f", True),
    ],
)
async def test_tool_choice_reaches_admission_in_neutral_shape(
    client: TestClient, scripted: Scripted, sent: dict, mode: str, name: str | None,
    parallel: bool,
) -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    resp = await client.post("/v1/chat/completions", json=chat_body(tools=tools, **sent))
    assert resp.status == 200
    seen = scripted.seen[-1]
    assert seen.tools == tools  # admission hides them when the choice is none
    assert (seen.tool_choice.mode, seen.tool_choice.name, seen.tool_choice.parallel) == (
        mode, name, parallel)


@pytest.mark.parametrize(
    ("sent", "expected"),
    [
        ({"type": "text"}, None),
        ({"type": "json_object"}, OutputFormat(type="json_object")),
        ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}},
         OutputFormat(type="json_schema", schema={"type": "object"}, name="n")),
    ],
)
async def test_response_format_reaches_admission(
    client: TestClient, scripted: Scripted, sent: dict, expected: OutputFormat | None
) -> None:
    resp = await client.post("/v1/chat/completions", json=chat_body(response_format=sent))
    assert resp.status == 200
    assert scripted.seen[-1].response_format == expected


async def test_chat_logprobs_use_openai_shape(client: TestClient) -> None:
    resp = await client.post("/v1/chat/completions", json=chat_body(logprobs=True, top_logprobs=2))
    content = (await resp.json())["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == DELTAS
    assert content[0] == {
        "token": "Hel",
        "logprob": -0.25,
        "bytes": [72, 101, 108],
        "top_logprobs": [
            {"token": "Hel", "logprob": -0.25, "bytes": [72, 101, 108]},
            {"token": "X", "logprob": -2.5, "bytes": [88]},
        ],
    }


async def test_finish_reason_length_is_passed_through(client: TestClient) -> None:
    body = await (await client.post("/v1/chat/completions", json=chat_body("length"))).json()
    assert body["choices"][0]["finish_reason"] == "length"


async def test_chat_stream_sends_role_deltas_finish_then_done(client: TestClient) -> None:
    resp = await client.post("/v1/chat/completions", json=chat_body(stream=True))
    assert resp.status == 200
    chunks = await read_sse(resp)
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["model"] == MODEL and "usage" not in c for c in chunks)
    choices = [c["choices"] for c in chunks]
    assert choices[0] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    assert [c[0]["delta"] for c in choices[1:-1]] == [{"content": d} for d in DELTAS]
    assert all(c[0]["finish_reason"] is None for c in choices[1:-1])
    assert choices[-1] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]


async def test_chat_stream_include_usage_ends_with_usage_chunk(client: TestClient) -> None:
    resp = await client.post(
        "/v1/chat/completions",
        json=chat_body(stream=True, stream_options={"include_usage": True}),
    )
    chunks = await read_sse(resp)
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 4,  # the 3 deltas and the end-of-sequence token
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 2},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


async def test_chat_stream_deltas_carry_logprobs(client: TestClient) -> None:
    resp = await client.post(
        "/v1/chat/completions", json=chat_body(stream=True, logprobs=True, top_logprobs=2)
    )
    chunks = await read_sse(resp)
    tokens = [c["choices"][0]["logprobs"]["content"][0]["token"] for c in chunks[1:-1]]
    assert tokens == DELTAS


# --- legacy completions --------------------------------------------------------------------


async def test_completion_has_text_completion_shape(client: TestClient, scripted: Scripted) -> None:
    resp = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 9, "stop": []}
    )
    assert resp.status == 200
    body = await resp.json()
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert body["model"] == MODEL
    assert body["choices"] == [
        {"index": 0, "text": "Hello world", "logprobs": None, "finish_reason": "stop"}
    ]
    assert body["usage"]["total_tokens"] == 9
    msg = scripted.seen[-1]
    assert isinstance(msg, AdmitCompletion)
    assert (msg.request_id, msg.prompt, msg.sampling.max_tokens) == (body["id"], "hello", 9)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [([1, 2, 3], [1, 2, 3]), (["hello"], "hello"), ([[4, 5]], [4, 5])],
)
async def test_completion_prompt_may_be_token_ids_or_a_one_item_list(
    client: TestClient, scripted: Scripted, prompt: Any, expected: Any
) -> None:
    resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
    assert resp.status == 200
    assert scripted.seen[-1].prompt == expected


async def test_completion_legacy_logprobs_shape(client: TestClient, scripted: Scripted) -> None:
    resp = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "hello", "logprobs": 2}
    )
    logprobs = (await resp.json())["choices"][0]["logprobs"]
    assert logprobs == {
        "tokens": DELTAS,
        "token_logprobs": [-0.25, -0.25, -0.25],
        "top_logprobs": [{d: -0.25, "X": -2.5} for d in DELTAS],
        "text_offset": [0, 3, 5],
    }
    assert (
        scripted.seen[-1].sampling.logprobs,
        scripted.seen[-1].sampling.top_logprobs,
    ) == (
        True,
        2,
    )


async def test_completion_stream_chunks_then_usage_then_done(client: TestClient) -> None:
    resp = await client.post(
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "hello",
            "stream": True,
            "logprobs": 0,
            "stream_options": {"include_usage": True},
        },
    )
    chunks = await read_sse(resp)
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert [c["choices"][0]["text"] for c in chunks[:3]] == DELTAS
    # text_offset keeps counting across chunks
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in chunks[:3]] == [[0], [3], [5]]
    assert chunks[3]["choices"] == [
        {"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}
    ]
    assert chunks[4]["choices"] == [] and chunks[4]["usage"]["completion_tokens"] == 4
    assert len(chunks) == 5


# --- models and health ---------------------------------------------------------------------


async def test_models_lists_what_admission_serves(client: TestClient) -> None:
    resp = await client.get("/v1/models")
    assert resp.status == 200
    body = await resp.json()
    assert body["object"] == "list"
    [model] = body["data"]
    assert set(model) == {"id", "object", "created", "owned_by", "root", "max_model_len"}
    assert (model["id"], model["object"], model["owned_by"]) == (MODEL, "model", "mlx-troupe")
    assert model["root"] == MODEL
    assert model["max_model_len"] == 4096  # the scripted model's context


async def test_health_is_ok_while_admission_runs(client: TestClient, scripted: Scripted) -> None:
    resp = await client.get("/health")
    assert resp.status == 200
    assert await resp.json() == {"status": "ok"}
    await scripted.system.stop(scripted.admission)
    resp = await client.get("/health")
    assert resp.status == 503
    assert_error_shape(await resp.json())


# --- errors --------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


def _chat(**fields: Any) -> bytes:
    return _json(chat_body(**fields))


BAD_REQUESTS = [
    pytest.param(CHAT, b'{"model": "tiny-test", "messages": [', None, id="malformed-json"),
    pytest.param(CHAT, b"", None, id="empty-body"),
    pytest.param(CHAT, b"[1, 2]", None, id="body-not-an-object"),
    pytest.param(CHAT, '{"model": "é'.encode("latin-1") + b'"}', None, id="not-utf8"),
    pytest.param(CHAT, _chat(temperature="hot"), "temperature", id="wrong-type"),
    pytest.param(CHAT, _chat(temperature=2.5), "temperature", id="temperature-range"),
    pytest.param(CHAT, _chat(top_p=0), "top_p", id="top-p-zero"),
    pytest.param(CHAT, _chat(top_k=-1), "top_k", id="top-k-negative"),
    pytest.param(CHAT, _chat(max_tokens=1.5), "max_tokens", id="max-tokens-float"),
    pytest.param(CHAT, _chat(stream="yes"), "stream", id="stream-not-bool"),
    pytest.param(CHAT, _chat(presence_penalty=-3), "presence_penalty", id="penalty-range"),
    pytest.param(CHAT, _json({"model": MODEL}), "messages", id="missing-messages"),
    pytest.param(CHAT, _json({"messages": chat_body()["messages"]}), "model", id="missing-model"),
    pytest.param(CHAT, _json({"model": MODEL, "messages": []}), "messages", id="no-messages"),
    pytest.param(
        CHAT,
        _json({"model": MODEL, "messages": [{"content": "hi"}]}),
        "messages[0].role",
        id="missing-role",
    ),
    pytest.param(
        CHAT,
        _json({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}),
        "messages[0].role",
        id="unknown-role",
    ),
    pytest.param(
        CHAT,
        _json(
            {
                "model": MODEL,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this?"},
                            {"type": "image_url", "image_url": {"url": "data:..."}},
                        ],
                    }
                ],
            }
        ),
        "messages[0].content[1].image_url",
        id="malformed-image-url",
    ),
    pytest.param(
        CHAT,
        _json({"model": MODEL, "messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}),
        "messages[0].content[0]",
        id="audio-part",
    ),
    pytest.param(CHAT, _chat(n=2), "n", id="n-above-one"),
    pytest.param(CHAT, _chat(top_logprobs=2), "top_logprobs", id="top-logprobs-without-logprobs"),
    pytest.param(CHAT, _chat(logprobs=True, top_logprobs=21), "top_logprobs", id="top-logprobs-21"),
    pytest.param(CHAT, _chat(stop=["a", "b", "c", "d", "e"]), "stop", id="five-stops"),
    pytest.param(CHAT, _chat(stop=[""]), "stop", id="empty-stop"),
    pytest.param(
        CHAT, _chat(response_format={"type": "yaml"}), "response_format", id="unknown-format"
    ),
    pytest.param(CHAT, _chat(tool_choice="always"), "tool_choice", id="bad-tool-choice"),
    pytest.param(
        COMPLETIONS, _json({"model": MODEL, "prompt": ["a", "b"]}), "prompt", id="batch-prompts"
    ),
    pytest.param(COMPLETIONS, _json({"model": MODEL, "prompt": []}), "prompt", id="empty-prompt"),
    pytest.param(COMPLETIONS, _json({"model": MODEL}), "prompt", id="missing-prompt"),
    pytest.param(
        COMPLETIONS, _json({"model": MODEL, "prompt": "a", "echo": True}), "echo", id="echo"
    ),
    pytest.param(
        COMPLETIONS,
        _json({"model": MODEL, "prompt": "a", "logprobs": 6}),
        "logprobs",
        id="legacy-logprobs-6",
    ),
    pytest.param(
        COMPLETIONS,
        _json({"model": MODEL, "prompt": "a", "logprobs": True}),
        "logprobs",
        id="legacy-logprobs-bool",
    ),
    pytest.param(
        COMPLETIONS, _json({"model": MODEL, "prompt": [1, -2]}), "prompt[1]", id="negative-token"
    ),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_REQUESTS)
async def test_bad_request_is_400_in_error_shape_and_server_keeps_serving(
    client: TestClient, scripted: Scripted, path: str, body: bytes, param: str | None
) -> None:
    resp = await client.post(path, data=body, headers={"Content-Type": "application/json"})
    assert resp.status == 400
    error = assert_error_shape(await resp.json(), param=param)
    assert error["type"] == "invalid_request_error"
    assert scripted.seen == []  # refused before admission
    await assert_still_serving(client)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_stop_sequences_over_their_total_size_are_a_400_naming_the_limit(
    client: TestClient, scripted: Scripted, path: str
) -> None:
    def ask(stop: list[str]) -> dict[str, Any]:
        if path == CHAT:
            return chat_body(stop=stop)
        return {"model": MODEL, "prompt": "hello", "stop": stop}

    at_the_limit = ["x" * (MAX_STOP_CHARS // 4)] * 4  # OpenAI's 4, of the size allowed
    resp = await client.post(path, json=ask(at_the_limit))
    assert resp.status == 200, await resp.text()
    assert scripted.seen[-1].sampling.stop == at_the_limit
    resp = await client.post(path, json=ask([*at_the_limit[:3], at_the_limit[3] + "x"]))
    assert resp.status == 400
    error = assert_error_shape(await resp.json(), param="stop")
    assert f"the limit is {MAX_STOP_CHARS}" in error["message"]
    assert len(scripted.seen) == 1  # refused before admission


async def test_oversized_body_is_413_in_error_shape(client: TestClient) -> None:
    body = _chat(content="x" * (MAX_BODY + 1))
    resp = await client.post(CHAT, data=body, headers={"Content-Type": "application/json"})
    assert resp.status == 413
    assert_error_shape(await resp.json())
    await assert_still_serving(client)


async def test_unknown_route_is_404_in_error_shape(client: TestClient) -> None:
    resp = await client.post("/v1/nothing-here", json={})
    assert resp.status == 404
    assert "/v1/nothing-here" in assert_error_shape(await resp.json())["message"]
    await assert_still_serving(client)


async def test_wrong_method_is_405_in_error_shape_with_allow(client: TestClient) -> None:
    resp = await client.get(CHAT)
    assert resp.status == 405
    assert resp.headers["Allow"] == "POST"
    assert_error_shape(await resp.json())
    await assert_still_serving(client)


async def test_unknown_model_404_from_admission_is_relayed(client: TestClient) -> None:
    body = chat_body()
    body["model"] = "no-such-model"
    resp = await client.post(CHAT, json=body)
    assert resp.status == 404
    error = assert_error_shape(await resp.json(), param="model")
    assert error["code"] == "model_not_found"
    assert "no-such-model" in error["message"]
    await assert_still_serving(client)


@pytest.mark.parametrize("stream", [False, True])
async def test_admission_429_is_relayed_with_retry_after(client: TestClient, stream: bool) -> None:
    body = chat_body(stream=stream)
    body["model"] = BUSY_MODEL
    resp = await client.post(CHAT, json=body)
    assert resp.status == 429
    assert resp.headers["Retry-After"] == "3"  # 2.5 s, rounded up
    assert_error_shape(await resp.json())
    await assert_still_serving(client)


@pytest.mark.parametrize("stream", [False, True])
async def test_refusal_before_start_answers_its_status_not_200(
    client: TestClient, stream: bool
) -> None:
    resp = await client.post(CHAT, json=chat_body("refuse-before-start", stream=stream))
    assert resp.status == 429
    assert resp.headers["Content-Type"].startswith("application/json")
    error = assert_error_shape(await resp.json())
    assert error["message"] == "The scheduler queue is full."
    assert error["type"] == "rate_limit_error"
    await assert_still_serving(client)


async def test_error_after_start_in_stream_is_error_event_then_done(client: TestClient) -> None:
    resp = await client.post(CHAT, json=chat_body("fail-mid-stream", stream=True))
    assert resp.status == 200
    chunks = await read_sse(resp)
    assert chunks[1]["choices"][0]["delta"] == {"content": "partial"}
    error = assert_error_shape(chunks[-1])
    assert error["message"] == "Out of memory during decode."
    assert error["type"] == "server_error"
    await assert_still_serving(client)


async def test_error_after_start_without_stream_answers_error_status(client: TestClient) -> None:
    resp = await client.post(CHAT, json=chat_body("fail-mid-stream"))
    assert resp.status == 503
    assert assert_error_shape(await resp.json())["message"] == "Out of memory during decode."
    await assert_still_serving(client)


async def test_unexpected_exception_is_500_server_error(client: TestClient) -> None:
    resp = await client.post(CHAT, json=chat_body("crash-admission"))
    assert resp.status == 500
    error = assert_error_shape(await resp.json())
    assert error["type"] == "server_error"
    assert "admission bug" not in error["message"]  # internals stay in the log
    await assert_still_serving(client)


# --- client disconnects --------------------------------------------------------------------


async def test_client_disconnect_mid_stream_closes_events_stream(
    client: TestClient, scripted: Scripted
) -> None:
    resp = await client.post(CHAT, json=chat_body("endless", stream=True))
    assert resp.status == 200
    await resp.content.readuntil(b"\n\n")  # the role chunk
    await resp.content.readuntil(b"\n\n")  # the first delta
    resp.close()  # drop the connection mid-stream
    await asyncio.wait_for(scripted.record.consumer_gone.wait(), timeout=5)
    assert scripted.record.tokens_sent < ENDLESS
    await assert_still_serving(client)


async def test_client_disconnect_while_waiting_closes_events_stream(
    client: TestClient, scripted: Scripted
) -> None:
    with pytest.raises(asyncio.TimeoutError):
        await client.post(CHAT, json=chat_body("endless"), timeout=aiohttp.ClientTimeout(total=0.2))
    await asyncio.wait_for(scripted.record.consumer_gone.wait(), timeout=5)
    await assert_still_serving(client)


# --- API key and CORS ----------------------------------------------------------------------


async def test_api_key_is_required_on_v1_when_configured(
    aiohttp_client: Any, scripted: Scripted
) -> None:
    client = await aiohttp_client(scripted.app(api_key="sekret"))
    resp = await client.post(CHAT, json=chat_body())
    assert resp.status == 401
    assert assert_error_shape(await resp.json())["code"] == "invalid_api_key"
    resp = await client.post(CHAT, json=chat_body(), headers={"Authorization": "Bearer wrong"})
    assert resp.status == 401
    resp = await client.post(CHAT, json=chat_body(), headers={"Authorization": "Bearer sekret"})
    assert resp.status == 200
    resp = await client.post(CHAT, json=chat_body(), headers={"x-api-key": "sekret"})
    assert resp.status == 200
    assert (await client.get("/health")).status == 200


async def test_cors_allows_configured_origins_only(
    aiohttp_client: Any, scripted: Scripted
) -> None:
    client = await aiohttp_client(scripted.app(allowed_origins=["http://ui.local"]))
    preflight = {"Origin": "http://ui.local", "Access-Control-Request-Method": "POST"}
    resp = await client.options(CHAT, headers=preflight)
    assert resp.status == 204
    assert resp.headers["Access-Control-Allow-Origin"] == "http://ui.local"
    assert "POST" in resp.headers["Access-Control-Allow-Methods"]
    resp = await client.post(
        CHAT, json=chat_body(stream=True), headers={"Origin": "http://ui.local"}
    )
    assert resp.headers["Access-Control-Allow-Origin"] == "http://ui.local"
    await read_sse(resp)
    resp = await client.post(CHAT, json=chat_body(), headers={"Origin": "http://evil.local"})
    assert "Access-Control-Allow-Origin" not in resp.headers
    resp = await client.options(CHAT, headers={**preflight, "Origin": "http://evil.local"})
    assert resp.status == 405


# --- the official openai client --------------------------------------------------------------




async def test_openai_client_chat_create(openai_client: openai.AsyncOpenAI) -> None:
    completion = await openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=5
    )
    assert completion.choices[0].message.content == "Hello world"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and completion.usage.total_tokens == 9


async def test_openai_client_chat_stream(openai_client: openai.AsyncOpenAI) -> None:
    stream = await openai_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = [], None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert "".join(text) == "Hello world"
    assert usage is not None and usage.completion_tokens == 4


async def test_openai_client_completions_create(openai_client: openai.AsyncOpenAI) -> None:
    completion = await openai_client.completions.create(model=MODEL, prompt="hello")
    assert completion.choices[0].text == "Hello world"


async def test_openai_client_sees_unknown_model_as_not_found(
    openai_client: openai.AsyncOpenAI,
) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await openai_client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hello"}]
        )
    assert caught.value.code == "model_not_found"


async def test_openai_client_tool_calls_whole(openai_client: openai.AsyncOpenAI) -> None:
    completion = await openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "tool-call"}])
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == TOOL_TEXT
    calls = [(c.id, c.type, c.function.name, c.function.arguments)
             for c in choice.message.tool_calls]
    assert calls == [(c.id, "function", c.name, c.arguments) for c in TOOL_CALLS]


async def test_openai_client_tool_calls_streamed_id_name_then_arguments(
    openai_client: openai.AsyncOpenAI,
) -> None:
    stream = await openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "tool-call"}], stream=True)
    text, calls, finish = "", {}, None
    async for chunk in stream:
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for part in delta.tool_calls or ():
            if part.index not in calls:  # the first fragment of a call names it
                assert part.id and part.function.name and part.type == "function"
                calls[part.index] = [part.id, part.function.name, ""]
            calls[part.index][2] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert text == TOOL_TEXT and finish == "tool_calls"
    assert [tuple(calls[i]) for i in sorted(calls)] == [
        (c.id, c.name, c.arguments) for c in TOOL_CALLS]


async def test_openai_client_reasoning_content_and_tokens(
    openai_client: openai.AsyncOpenAI,
) -> None:
    messages = [{"role": "user", "content": "reasoning"}]
    completion = await openai_client.chat.completions.create(model=MODEL, messages=messages)
    message = completion.choices[0].message
    assert message.content == "Hello world"
    assert message.model_extra["reasoning_content"] == "".join(REASONING)
    assert completion.usage.completion_tokens_details.reasoning_tokens == len(REASONING)
    stream = await openai_client.chat.completions.create(
        model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True})
    reasoning, text = "", ""
    async for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            text += delta.content or ""
    assert (reasoning, text) == ("".join(REASONING), "Hello world")
