"""Ollama's API (api/ollama.py): shapes, NDJSON streams and errors on the scripted admission,
what each request becomes, the official ``ollama`` client, then the client against the real
serving stack on the tiny model (the same greedy answer as OpenAI's route).
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import http_stack
import ollama
import openai
import pytest
from aiohttp.test_utils import TestClient
from http_stack import BUSY_MODEL, DELTAS, MODEL, REASONING, STOP, TOOL_TEXT, Scripted, real_stack
from PIL import Image

from troupe.actors.messages import AdmitChat, AdmitCompletion, AdmitEmbed, OutputFormat

scripted, client = http_stack.scripted, http_stack.client

CHAT, GENERATE = "/api/chat", "/api/generate"
NDJSON = "application/x-ndjson"


def chat(content: str = "hello", **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


def lines(text: str) -> list[dict[str, Any]]:
    """An NDJSON body's objects: every line one whole JSON object."""
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def png() -> str:
    out = io.BytesIO()
    Image.new("RGB", (4, 4), (200, 10, 10)).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


# --- the answer ----------------------------------------------------------------------------


async def test_a_whole_chat_answer_has_ollama_s_shape_counts_and_durations(
        client: TestClient) -> None:
    resp = await client.post(CHAT, json=chat(stream=False))
    assert resp.status == 200 and resp.content_type == "application/json"
    data = await resp.json()
    assert data["model"] == MODEL and data["created_at"].endswith("Z")
    assert data["message"] == {"role": "assistant", "content": "Hello world"}
    assert (data["done"], data["done_reason"]) == (True, "stop")
    assert (data["prompt_eval_count"], data["eval_count"]) == (5, 4)
    for key in ("total_duration", "prompt_eval_duration", "eval_duration", "load_duration"):
        assert isinstance(data[key], int) and data[key] >= 0
    assert data["total_duration"] >= data["eval_duration"]


async def test_a_chat_streams_ndjson_by_default_ending_with_a_done_object(
        client: TestClient) -> None:
    resp = await client.post(CHAT, json=chat())  # no "stream": Ollama streams
    assert resp.status == 200 and resp.content_type == NDJSON
    objects = lines(await resp.text())
    assert [o["message"]["content"] for o in objects[:-1]] == DELTAS
    assert all(o["done"] is False and "done_reason" not in o for o in objects[:-1])
    last = objects[-1]
    assert last["done"] is True and last["message"]["content"] == ""
    assert (last["done_reason"], last["eval_count"]) == ("stop", 4)


@pytest.mark.parametrize("stream", [False, True])
async def test_the_length_limit_is_done_reason_length(client: TestClient, stream: bool) -> None:
    resp = await client.post(CHAT, json=chat("length", stream=stream))
    last = lines(await resp.text())[-1] if stream else await resp.json()
    assert last["done_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_calls_carry_their_arguments_as_objects(client: TestClient,
                                                           stream: bool) -> None:
    resp = await client.post(CHAT, json=chat("tool-call", stream=stream))
    if stream:
        objects = lines(await resp.text())
        text = "".join(o["message"]["content"] for o in objects)
        calls = [c for o in objects for c in o["message"].get("tool_calls", [])]
        assert objects[-1]["done_reason"] == "stop"
    else:
        data = await resp.json()
        text, calls = data["message"]["content"], data["message"]["tool_calls"]
    assert text == TOOL_TEXT
    assert calls == [
        {"id": "call_0", "function": {"index": 0, "name": "get_weather",
                                      "arguments": {"city": "Paris"}}},
        {"id": "call_1", "function": {"index": 1, "name": "get_time",
                                      "arguments": {"zone": "CET"}}},
    ]


@pytest.mark.parametrize("stream", [False, True])
async def test_reasoning_is_the_message_s_thinking(client: TestClient, stream: bool) -> None:
    resp = await client.post(CHAT, json=chat("reasoning", stream=stream, think=True))
    if stream:
        objects = lines(await resp.text())
        thinking = [o["message"]["thinking"] for o in objects if "thinking" in o["message"]]
        assert thinking == REASONING
        assert "".join(o["message"]["content"] for o in objects) == "".join(DELTAS)
    else:
        message = (await resp.json())["message"]
        assert message == {"role": "assistant", "content": "".join(DELTAS),
                           "thinking": "".join(REASONING)}


@pytest.mark.parametrize("stream", [False, True])
async def test_logprobs_come_with_each_token_and_its_likeliest_neighbours(
        client: TestClient, scripted: Scripted, stream: bool) -> None:
    resp = await client.post(CHAT, json=chat(stream=stream, logprobs=True, top_logprobs=2))
    assert resp.status == 200
    msg = scripted.seen[-1]
    assert (msg.sampling.logprobs, msg.sampling.top_logprobs) == (True, 2)
    objects = lines(await resp.text()) if stream else [await resp.json()]
    items = [item for o in objects for item in o.get("logprobs") or []]
    assert [item["token"] for item in items] == DELTAS
    first = items[0]
    assert first == {"token": "Hel", "logprob": -0.25, "bytes": list(b"Hel"),
                     "top_logprobs": [{"token": "Hel", "logprob": -0.25, "bytes": list(b"Hel")},
                                      {"token": "X", "logprob": -2.5, "bytes": [88]}]}
    plain = await client.post(CHAT, json=chat(stream=False))
    assert "logprobs" not in await plain.json()


async def test_generate_answers_in_response_whole_and_streamed(client: TestClient) -> None:
    whole = await (await client.post(GENERATE, json={"model": MODEL, "prompt": "hello",
                                                     "stream": False})).json()
    assert (whole["response"], whole["done"], whole["done_reason"]) == ("Hello world", True,
                                                                       "stop")
    resp = await client.post(GENERATE, json={"model": MODEL, "prompt": "hello"})
    assert resp.content_type == NDJSON
    objects = lines(await resp.text())
    assert [o["response"] for o in objects] == [*DELTAS, ""]
    assert objects[-1]["done"] is True and objects[-1]["eval_count"] == 4


# --- what a request becomes ------------------------------------------------------------------


async def test_a_chat_becomes_the_admission_message_an_openai_client_would_send(
        client: TestClient, scripted: Scripted) -> None:
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    image = png()
    resp = await client.post(CHAT, json={
        "model": MODEL, "stream": False, "tools": [tool], "keep_alive": "5m",
        "options": {"temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 7,
                    "num_predict": 12, "stop": ["X", "Y"], "repeat_penalty": 1.1,
                    "num_ctx": 8192, "num_gpu": 99},
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "what is this?", "images": [image]},
            {"role": "assistant", "content": "", "thinking": "hmm", "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
            # Arguments as JSON text (what a client relaying OpenAI's calls sends), an id kept.
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c7",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "content": "snow", "tool_call_id": "c7"},
            {"role": "user", "content": "hello"},
        ],
        "some_future_field": True,
    })
    assert resp.status == 200, await resp.text()
    msg = scripted.seen[-1]
    assert isinstance(msg, AdmitChat)
    call_id = msg.messages[2]["tool_calls"][0]["id"]
    assert msg.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [
            {"type": "image", "image": {"data": image, "media_type": None,
                                        "param": "messages[1].images[0]"}},
            {"type": "text", "text": "what is this?"}]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        # A tool message without an id answers the earliest call not yet answered.
        {"role": "tool", "content": "sunny", "tool_call_id": call_id, "name": "get_weather"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c7", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "snow", "tool_call_id": "c7"},
        {"role": "user", "content": "hello"},
    ]
    assert msg.tools == [tool]
    s = msg.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.min_p, s.seed, s.stop,
            s.repetition_penalty) == (12, 0.5, 0.9, 40, 0.05, 7, ["X", "Y"], 1.1)
    assert "temperature" not in msg.unset and msg.response_format is None


async def test_unsent_options_keep_the_model_s_defaults_and_the_server_s_max_tokens(
        client: TestClient, scripted: Scripted) -> None:
    for options in (None, {"num_predict": -1}, {"num_predict": -2}):
        resp = await client.post(CHAT, json=chat(stream=False, options=options))
        assert resp.status == 200
        msg = scripted.seen[-1]
        assert msg.sampling.max_tokens == 77  # the scripted server's --default-max-tokens
        assert {"temperature", "top_p", "top_k"} <= set(msg.unset)


@pytest.mark.parametrize(("fmt", "want"), [
    ("json", OutputFormat(type="json_object")),
    ({"type": "object", "properties": {"a": {"type": "integer"}}},
     OutputFormat(type="json_schema",
                  schema={"type": "object", "properties": {"a": {"type": "integer"}}})),
])
async def test_format_is_a_json_constraint(client: TestClient, scripted: Scripted,
                                           fmt: Any, want: OutputFormat) -> None:
    resp = await client.post(CHAT, json=chat(stream=False, format=fmt))
    assert resp.status == 200
    assert scripted.seen[-1].response_format == want


@pytest.mark.parametrize(("think", "kwargs"), [
    (True, {"enable_thinking": True}), (False, {"enable_thinking": False}),
    ("high", {"enable_thinking": True, "reasoning_effort": "high"}), (None, None)])
async def test_think_is_the_template_s_switch(client: TestClient, scripted: Scripted,
                                              think: Any, kwargs: Any) -> None:
    resp = await client.post(CHAT, json=chat(stream=False, think=think))
    assert resp.status == 200
    assert scripted.seen[-1].chat_template_kwargs == kwargs


async def test_generate_goes_through_the_template_unless_raw(client: TestClient,
                                                             scripted: Scripted) -> None:
    await client.post(GENERATE, json={"model": MODEL, "prompt": "hello", "system": "be brief",
                                      "stream": False, "options": {"num_predict": 9}})
    msg = scripted.seen[-1]
    assert isinstance(msg, AdmitChat)
    assert msg.messages == [{"role": "system", "content": "be brief"},
                            {"role": "user", "content": "hello"}]
    await client.post(GENERATE, json={"model": MODEL, "prompt": "hello", "raw": True,
                                      "stream": False, "format": "json"})
    msg = scripted.seen[-1]
    assert isinstance(msg, AdmitCompletion)
    assert (msg.prompt, msg.response_format) == ("hello", OutputFormat(type="json_object"))
    assert msg.suffix is None
    # A suffix: code completion between the two (the model's fill-in-the-middle tokens).
    await client.post(GENERATE, json={"model": MODEL, "prompt": "hello", "suffix": "world",
                                      "system": "ignored", "stream": False})
    msg = scripted.seen[-1]
    assert isinstance(msg, AdmitCompletion) and (msg.prompt, msg.suffix) == ("hello", "world")


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "status", "words"), [
    ({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "does not exist"),
    ({"model": MODEL, "messages": []}, 400, "messages must not be empty"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
    (chat(format="yaml"), 400, "format 'yaml'"),
    (chat(options={"num_predict": 0}), 400, "num_predict"),
    (chat(options={"temperature": 9}), 400, "temperature"),
    (chat(top_logprobs=2), 400, "top_logprobs requires logprobs"),
    ({"model": MODEL, "messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "[1]"}}]}]}, 400, "must be an object"),
    ({"model": MODEL, "messages": [{"role": "assistant", "content": "x", "images": [png()]}]},
     400, "images"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x", "images": ["%%%"]}]},
     400, "base64"),
    ({**chat(), "model": BUSY_MODEL}, 429, "Too many requests"),
])
async def test_refusals_are_ollama_errors_with_their_status(
        client: TestClient, body: dict[str, Any], status: int, words: str) -> None:
    resp = await client.post(CHAT, json=body)
    assert resp.status == status, await resp.text()
    assert resp.content_type == "application/json"
    data = await resp.json()
    assert set(data) == {"error"} and words in data["error"]
    ok = await client.post(CHAT, json=chat(stream=False))  # still serving
    assert ok.status == 200


async def test_a_failure_after_the_start_is_the_stream_s_last_line(client: TestClient) -> None:
    resp = await client.post(CHAT, json=chat("fail-mid-stream"))
    assert resp.status == 200
    objects = lines(await resp.text())
    assert objects[-1] == {"error": "Out of memory during decode."}
    assert all("error" not in o for o in objects[:-1])


async def test_generate_refuses_what_it_does_not_serve(client: TestClient) -> None:
    for body, words in (({"model": MODEL, "prompt": ""}, "prompt must not be empty"),
                        ({"model": MODEL, "prompt": "x", "template": "{{ .Prompt }}"},
                         "'template'"),
                        ({"model": MODEL, "prompt": "x", "suffix": "y", "images": [png()]},
                         "suffix cannot hold images"),
                        ({"model": MODEL, "prompt": "x", "raw": True, "images": [png()]},
                         "raw prompt")):
        resp = await client.post(GENERATE, json=body)
        assert resp.status == 400
        assert words in (await resp.json())["error"]


async def test_an_unknown_ollama_route_answers_in_ollama_s_shape(client: TestClient) -> None:
    resp = await client.get("/api/nothing")
    assert resp.status == 404
    assert set(await resp.json()) == {"error"}


# --- models and embeddings -------------------------------------------------------------------


async def test_tags_ps_show_and_version_describe_the_served_models(client: TestClient) -> None:
    tags = await (await client.get("/api/tags")).json()
    assert [m["name"] for m in tags["models"]] == [MODEL]
    assert {"name", "model", "size", "digest", "details", "modified_at"} <= set(tags["models"][0])
    ps = await (await client.get("/api/ps")).json()
    assert ps["models"][0]["context_length"] == 4096 and ps["models"][0]["expires_at"]
    show = await client.post("/api/show", json={"model": MODEL})
    data = await show.json()
    assert data["capabilities"][:2] == ["completion", "tools"]
    arch = data["model_info"]["general.architecture"]
    assert data["model_info"][f"{arch}.context_length"] == 4096
    # Ollama's default tag: a name with ":latest" is the name.
    tagged = await (await client.post("/api/show", json={"model": f"{MODEL}:latest"})).json()
    assert tagged["capabilities"] == data["capabilities"]
    answer = await client.post(CHAT, json={**chat(stream=False), "model": f"{MODEL}:latest"})
    assert (await answer.json())["message"]["content"] == "Hello world"
    missing = await client.post("/api/show", json={"model": "nope"})
    assert missing.status == 404 and "error" in await missing.json()
    version = await (await client.get("/api/version")).json()
    assert version["version"].count(".") == 2


async def test_embed_and_the_older_embeddings_route(client: TestClient,
                                                    scripted: Scripted) -> None:
    data = await (await client.post("/api/embed", json={"model": MODEL,
                                                        "input": ["a", "b"]})).json()
    assert data["embeddings"] == [[1.0, 0.0, 0.0, 0.0]] * 2
    assert data["prompt_eval_count"] == 10
    msg = scripted.seen[-1]
    assert isinstance(msg, AdmitEmbed) and (msg.inputs, msg.truncate) == (["a", "b"], True)
    one = await (await client.post("/api/embed", json={"model": MODEL, "input": "a",
                                                       "dimensions": 2})).json()
    assert one["embeddings"] == [[1.0, 0.0]]
    old = await (await client.post("/api/embeddings", json={"model": MODEL,
                                                            "prompt": "a"})).json()
    assert old == {"embedding": [1.0, 0.0, 0.0, 0.0]}


# --- the official ollama client ----------------------------------------------------------------


async def test_the_ollama_client_chats_streams_generates_and_lists(scripted: Scripted) -> None:
    server = await scripted.start()
    client = ollama.AsyncClient(host=server.url)
    try:
        answer = await client.chat(model=MODEL, messages=[{"role": "user", "content": "hello"}])
        assert answer.message.content == "Hello world" and answer.done_reason == "stop"
        parts = [part async for part in await client.chat(
            model=MODEL, messages=[{"role": "user", "content": "tool-call"}], stream=True)]
        calls = [c for p in parts for c in p.message.tool_calls or []]
        assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
        thought = await client.chat(model=MODEL, think=True,
                                    messages=[{"role": "user", "content": "reasoning"}])
        assert thought.message.thinking == "".join(REASONING)
        generated = await client.generate(model=MODEL, prompt="stop-string",
                                          options={"stop": [STOP]})
        assert generated.response == "Hello world"
        assert [m.model for m in (await client.list()).models] == [MODEL]
        assert "tools" in (await client.show(MODEL)).capabilities
        assert (await client.embed(model=MODEL, input="a")).embeddings == [[1.0, 0.0, 0.0, 0.0]]
        with pytest.raises(ollama.ResponseError) as caught:
            await client.chat(model="nope", messages=[{"role": "user", "content": "hi"}])
        assert caught.value.status_code == 404 and "does not exist" in caught.value.error
        with pytest.raises(ollama.ResponseError) as caught:
            async for _ in await client.chat(
                    model=MODEL, messages=[{"role": "user", "content": "fail-mid-stream"}],
                    stream=True):
                pass
        assert "Out of memory" in caught.value.error
    finally:
        await server.close()


# --- the real stack ----------------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "The quick brown fox"},
]


async def test_the_ollama_client_gets_the_openai_route_s_greedy_answer_on_the_real_stack(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TROUPE_HOME", str(tmp_path))
    async with real_stack(tiny_model_dir) as stack:
        oai = openai.AsyncOpenAI(base_url=f"{stack.server.url}/v1", api_key="x", max_retries=0)
        client = ollama.AsyncClient(host=stack.server.url)
        options = {"temperature": 0, "num_predict": 24}
        try:
            answers = []
            for last in ("The quick brown fox", "Name three colours."):
                conversation = [*CONVERSATION[:-1], {"role": "user", "content": last}]
                reference = await oai.chat.completions.create(
                    model=stack.model, temperature=0, max_tokens=24, messages=conversation)
                expected = reference.choices[0].message.content
                got = await client.chat(model=stack.model, messages=conversation,
                                        options=options)
                assert got.message.content == expected
                assert got.eval_count == reference.usage.completion_tokens
                assert got.prompt_eval_count == reference.usage.prompt_tokens
                assert got.done_reason == {"stop": "stop", "length": "length"}[
                    reference.choices[0].finish_reason]
                streamed = [part async for part in await client.chat(
                    model=stack.model, messages=conversation, options=options, stream=True)]
                assert "".join(p.message.content for p in streamed) == expected
                assert streamed[-1].done and streamed[-1].eval_count == got.eval_count
                answers.append(expected)
            # Two prompts, two answers: the equalities above compare something.
            assert answers[0] != answers[1]
            # Log probabilities: the OpenAI route's, token by token.
            with_logprobs = await client.chat(model=stack.model, messages=conversation,
                                              options=options, logprobs=True, top_logprobs=2)
            reference = await oai.chat.completions.create(
                model=stack.model, temperature=0, max_tokens=24, messages=conversation,
                logprobs=True, top_logprobs=2)
            want = reference.choices[0].logprobs.content
            got_items = with_logprobs.logprobs or []
            assert [i.token for i in got_items] == [w.token for w in want]
            assert [i.logprob for i in got_items] == pytest.approx([w.logprob for w in want])
            assert [[t.token for t in i.top_logprobs or []] for i in got_items] == [
                [t.token for t in w.top_logprobs] for w in want]
            show = await client.show(stack.model)
            assert show.modelinfo[f"{show.modelinfo['general.architecture']}.context_length"] > 0
            # The tiny model's template has no reasoning tags and it reads no images.
            assert show.capabilities == ["completion", "tools"]
            count = show.modelinfo["general.parameter_count"]
            assert count > 0 and show.details.parameter_size == f"{count / 1e6:.2f}M"
            assert (await client.list()).models[0].size > 0
            assert [m.model for m in (await client.ps()).models] == [stack.model]
        finally:
            await oai.close()


async def test_a_reasoning_model_says_it_thinks_and_its_thinking_comes_apart(
        tiny_qwen3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny qwen3's template has <think> tags: /api/show says `thinking`, and a chat's
    answer splits as OpenAI's route splits it (the scripted tests above show where the
    reasoning goes)."""
    monkeypatch.setenv("TROUPE_HOME", str(tmp_path))
    async with real_stack(tiny_qwen3_dir) as stack:
        oai = openai.AsyncOpenAI(base_url=f"{stack.server.url}/v1", api_key="x", max_retries=0)
        client = ollama.AsyncClient(host=stack.server.url)
        try:
            show = await client.show(stack.model)
            assert show.capabilities == ["completion", "tools", "thinking"]
            messages = [{"role": "user", "content": "What is the capital of France?"}]
            reference = await oai.chat.completions.create(
                model=stack.model, temperature=0, max_tokens=48, messages=messages,
                extra_body={"chat_template_kwargs": {"enable_thinking": True}})
            got = await client.chat(model=stack.model, messages=messages, think=True,
                                    options={"temperature": 0, "num_predict": 48})
            want = reference.choices[0].message
            assert got.message.content == (want.content or "")
            assert got.message.thinking == (getattr(want, "reasoning_content", None) or None)
        finally:
            await oai.close()
