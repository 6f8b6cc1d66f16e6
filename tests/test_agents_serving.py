"""Agents on the real serving stack with a tiny random model: tools, constrained output, and
the prompt a template without a tool format is given.

The tiny model's ChatML template has no tool format, so its calls come from troupe's fallback
(tools written into the prompt, Hermes markup read back) and, when a call is required, from
the grammar: random weights still make a valid call.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
from http_stack import real_client

from troupe.actors.config import ServeConfig
from troupe.actors.tool_prompt import uses_tools, with_tools_in_prompt

TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up.",
        "parameters": {
            "type": "object",
            "properties": {"word": {"type": "string", "maxLength": 12},
                           "lang": {"enum": ["en", "fr"]}},
            "required": ["word", "lang"],
            "additionalProperties": False,
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"},
                   "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
    "required": ["ok", "items"],
    "additionalProperties": False,
}


async def _client(aiohttp_client: Any, model_dir: Path) -> tuple[Any, str]:
    config = ServeConfig(model=str(model_dir))
    client, _, handles = await real_client(aiohttp_client, config)
    return client, handles.models[0].id


def _chat(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "What is a fox?"}],
            "max_tokens": 200, "temperature": 0, **extra}


async def test_required_tool_call_from_a_random_model_is_valid(aiohttp_client, tiny_model_dir):
    client, model = await _client(aiohttp_client, tiny_model_dir)
    resp = await client.post("/v1/chat/completions",
                             json=_chat(model, tools=[TOOL], tool_choice="required",
                                        parallel_tool_calls=False))
    assert resp.status == 200, await resp.text()
    choice = (await resp.json())["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    calls = choice["message"]["tool_calls"]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "lookup"
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]),
                        TOOL["function"]["parameters"])
    assert choice["message"]["content"] is None


async def test_json_schema_answer_from_a_random_model_validates(aiohttp_client, tiny_model_dir):
    client, model = await _client(aiohttp_client, tiny_model_dir)
    body = _chat(model, response_format={"type": "json_schema",
                                         "json_schema": {"name": "s", "schema": SCHEMA}})
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    choice = (await resp.json())["choices"][0]
    if choice["finish_reason"] == "stop":
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    else:  # random weights may write long numbers until max_tokens
        assert choice["finish_reason"] == "length"
        assert choice["message"]["content"].startswith("{")


async def test_json_schema_on_legacy_completions_validates(aiohttp_client, tiny_model_dir):
    client, model = await _client(aiohttp_client, tiny_model_dir)
    schema = {"type": "object", "properties": {"lang": {"enum": ["en", "fr"]}},
              "required": ["lang"], "additionalProperties": False}
    resp = await client.post("/v1/completions", json={
        "model": model, "prompt": "JSON:", "max_tokens": 80, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "l",
                                                                  "schema": schema}}})
    assert resp.status == 200, await resp.text()
    choice = (await resp.json())["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["text"]), schema)


async def test_bad_tool_and_schema_requests_are_400_then_serving_goes_on(
    aiohttp_client, tiny_model_dir
):
    client, model = await _client(aiohttp_client, tiny_model_dir)
    bad = [
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0]"),
        ({"tools": "lookup"}, "tools"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "dependentSchemas": {"a": {}}}}}},
         "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "pattern": "(unclosed"}}}},
         "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
    ]
    for extra, param in bad:
        resp = await client.post("/v1/chat/completions", json=_chat(model, **extra))
        body = await resp.json()
        assert resp.status == 400, (extra, body)
        assert body["error"]["type"] == "invalid_request_error"
        assert body["error"]["param"].startswith(param), (extra, body)
    resp = await client.post("/v1/chat/completions", json=_chat(model, max_tokens=4))
    assert resp.status == 200


def test_fallback_prompt_carries_tools_calls_and_results():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Look up fox."},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "lookup",
                                      "arguments": '{"word": "fox", "lang": "en"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a small canid"},
        {"role": "tool", "tool_call_id": "call_2", "content": "un renard"},
    ]
    assert uses_tools(messages)
    out = with_tools_in_prompt(messages, [TOOL])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.") and '"name": "lookup"' in out[0]["content"]
    assert out[2]["content"] == ('<tool_call>\n{"name": "lookup", "arguments": '
                                 '{"word": "fox", "lang": "en"}}\n</tool_call>')
    assert out[3]["content"].count("<tool_response>") == 2
    assert "a small canid" in out[3]["content"] and "un renard" in out[3]["content"]
    assert all("tool_calls" not in m and "tool_call_id" not in m for m in out)
    # Tools hidden (tool_choice none): the history is still there, the tools are not.
    hidden = with_tools_in_prompt(messages, None)
    assert "<tools>" not in json.dumps(hidden) and "<tool_call>" in hidden[2]["content"]


async def test_tool_choice_none_hides_the_tools_from_the_prompt(aiohttp_client, tiny_model_dir):
    client, model = await _client(aiohttp_client, tiny_model_dir)

    async def prompt_tokens(**extra: Any) -> int:
        resp = await client.post("/v1/chat/completions", json=_chat(model, max_tokens=1, **extra))
        assert resp.status == 200, await resp.text()
        return (await resp.json())["usage"]["prompt_tokens"]

    plain = await prompt_tokens()
    assert await prompt_tokens(tools=[TOOL], tool_choice="none") == plain
    assert await prompt_tokens(tools=[TOOL]) > plain


async def test_constrained_answer_from_the_prefix_cache_is_the_same(aiohttp_client,
                                                                     tiny_model_dir):
    client, model = await _client(aiohttp_client, tiny_model_dir)
    body = _chat(model, messages=[{"role": "user", "content": "The quick brown fox " * 12}],
                 response_format={"type": "json_schema",
                                  "json_schema": {"name": "s", "schema": SCHEMA}})
    answers = []
    for _ in range(2):
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status == 200, await resp.text()
        answers.append(await resp.json())
    cold, warm = answers
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
    if cold["choices"][0]["finish_reason"] == "stop":
        jsonschema.validate(json.loads(cold["choices"][0]["message"]["content"]), SCHEMA)


# The schemas whose every value would nest without end (see test_finite_schema).
ENDLESS = [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
                     "required": ["c"]}},
     "$ref": "#/$defs/n"},
]


def _enforcing(model: str, schema: dict) -> list[tuple[str, dict[str, Any], str | None]]:
    """Every route's request that enforces ``schema`` (as the answer or as the parameters of
    a required call), and the ``param`` its refusal names (None: Anthropic's shape has none)."""
    go = {"type": "function", "function": {"name": "go", "parameters": schema}}
    ask = [{"role": "user", "content": "Go."}]
    return [
        ("/v1/chat/completions",
         _chat(model, response_format={"type": "json_schema",
                                       "json_schema": {"name": "s", "schema": schema}}),
         "response_format"),
        ("/v1/chat/completions", _chat(model, tools=[TOOL, go], tool_choice="required"),
         "tools[1].function.parameters"),
        ("/v1/completions",
         {"model": model, "prompt": "JSON:", "max_tokens": 8,
          "response_format": {"type": "json_schema",
                              "json_schema": {"name": "s", "schema": schema}}},
         "response_format"),
        ("/v1/messages",
         {"model": model, "max_tokens": 8, "messages": ask,
          "output_config": {"format": {"type": "json_schema", "schema": schema}}}, None),
        ("/v1/messages",
         {"model": model, "max_tokens": 8, "messages": ask,
          "tools": [{"name": "go", "input_schema": schema}], "tool_choice": {"type": "any"}},
         None),
        ("/v1/responses",
         {"model": model, "input": "Go.", "max_output_tokens": 8,
          "text": {"format": {"type": "json_schema", "name": "s", "schema": schema}}},
         "response_format"),
        ("/v1/responses",
         {"model": model, "input": "Go.", "max_output_tokens": 8,
          "tools": [{"type": "function", "name": "go", "parameters": schema}],
          "tool_choice": "required"},
         "tools[0].function.parameters"),
    ]


async def test_a_schema_no_finite_value_satisfies_is_400_on_every_route(
    aiohttp_client, tiny_model_dir
):
    """As the answer's format or an enforced call's parameters, such a schema is refused
    before any token, in the route's error shape; an auto call of that tool is served."""
    client, model = await _client(aiohttp_client, tiny_model_dir)
    for schema in ENDLESS:
        for path, body, param in _enforcing(model, schema):
            resp = await client.post(path, json=body)
            data = await resp.json()
            assert resp.status == 400, (path, body, data)
            assert data["error"]["type"] == "invalid_request_error", (path, data)
            assert "no finite JSON value satisfies this schema" in data["error"]["message"], data
            if param is not None:
                assert data["error"]["param"] == param, (path, data)
    go = {"type": "function", "function": {"name": "go", "parameters": ENDLESS[2]}}
    resp = await client.post("/v1/chat/completions", json=_chat(model, tools=[go], max_tokens=8))
    assert resp.status == 200, await resp.text()
