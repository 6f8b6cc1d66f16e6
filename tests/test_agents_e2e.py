"""End to end: agents against the bundled default model, through the official clients.

SmolLM2-135M's chat template has no tool format: its tool calls come from the constrained
path (the tools written into its prompt, the call's markup and arguments forced by the
grammar), so even this model always makes a valid call when one is required. The server is
conftest's session-wide ``server`` fixture.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["engineer", "artist", "teacher", "farmer"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16},
                   "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "country": {"type": "string", "maxLength": 20}},
            "required": ["city", "country"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "skills", "address"],
    "additionalProperties": False,
}

SUBJECTS = ["a painter from Lyon", "a farmer in Kenya", "a physics teacher", "a young coder",
            "a retired sailor", "a chef in Tokyo", "a violinist", "a bus driver in Oslo",
            "a nurse", "a mountain guide", "a librarian", "a robot engineer", "a potter",
            "a beekeeper", "a pilot", "a surfer from Lima", "a baker in Rome", "a poet",
            "a chess champion", "an astronaut"]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 30}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = "What is the weather in Paris right now?"


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=300)


def _person(client: openai.OpenAI, i: int) -> dict[str, Any]:
    """One json_schema answer, streamed for odd i: the parsed, validated object."""
    kwargs: dict[str, Any] = dict(
        model=MODEL, temperature=0, max_tokens=200,
        messages=[{"role": "user", "content": f"Describe {SUBJECTS[i]} as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )
    if i % 2:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        r = client.chat.completions.create(**kwargs)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert finish == "stop", (finish, text)
    answer = json.loads(text)
    jsonschema.validate(answer, PERSON)
    return answer


def test_json_schema_answers_all_validate_twenty_prompts_eight_at_a_time(
    client: openai.OpenAI,
) -> None:
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: _person(client, i), range(len(SUBJECTS))))
    assert len(answers) == 20
    # Different prompts, different answers: the grammar shapes them, the model fills them.
    assert len({json.dumps(a, sort_keys=True) for a in answers}) > 1


def test_json_object_answer_is_an_object(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=120, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give a city and its country as JSON."}])
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # a long answer cut by max_tokens is still the start of an object
        assert r.choices[0].finish_reason == "length"
        assert r.choices[0].message.content.lstrip().startswith("{")


def _check_call(name: str, arguments: str) -> dict[str, Any]:
    assert name in SCHEMAS, name
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def test_openai_agent_loop_required_call_then_tool_result_then_text(
    client: openai.OpenAI,
) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": ASK}]
    r = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=120,
                                       messages=messages, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls, choice.message
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id
    _check_call(call.function.name, call.function.arguments)
    assert "<tool_call>" not in (choice.message.content or "")
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id,
                     "content": json.dumps({"temperature": 21, "sky": "sunny"})})
    final = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=48,
                                           messages=messages, tools=TOOLS, tool_choice="none")
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.content.strip()
    assert not final.choices[0].message.tool_calls


def test_openai_named_tool_call_streamed_arrives_whole(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=120, stream=True, parallel_tool_calls=False,
        messages=[{"role": "user", "content": "What time is it in Berlin?"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}}))
    calls: dict[int, dict[str, str]] = {}
    content = ""
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or ():
            call = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += part.id or ""
            call["name"] += (part.function.name or "") if part.function else ""
            call["arguments"] += (part.function.arguments or "") if part.function else ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert list(calls) == [0]
    assert calls[0]["name"] == "get_time" and calls[0]["id"]
    _check_call("get_time", calls[0]["arguments"])
    assert "<tool_call>" not in content and "get_time" not in content


def test_anthropic_agent_loop_any_tool_then_tool_result_then_text(server: str) -> None:
    client = anthropic.Anthropic(base_url=server, api_key="unused", timeout=300)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    messages: list[dict[str, Any]] = [{"role": "user", "content": ASK}]
    first = client.messages.create(model=MODEL, max_tokens=120, messages=messages, tools=tools,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                   extra_body={"temperature": 0})
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert uses
    jsonschema.validate(uses[0].input, SCHEMAS[uses[0].name])
    messages.append({"role": "assistant", "content": [b.model_dump() for b in first.content]})
    messages.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": uses[0].id,
         "content": json.dumps({"temperature": 21, "sky": "sunny"})}]})
    with client.messages.stream(model=MODEL, max_tokens=48, messages=messages, tools=tools,
                                tool_choice={"type": "none"},
                                extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens")
    text = "".join(b.text for b in final.content if b.type == "text")
    assert text.strip()


# The SDK warns that this model name is deprecated: it is the name Claude Code sends.
@pytest.mark.filterwarnings("ignore:The model 'claude-sonnet-4-5-20250929' is deprecated")
def test_claude_codes_first_turn_is_served_by_the_default_model(server: str) -> None:
    client = anthropic.Anthropic(base_url=server, api_key="unused", timeout=300)
    ask = [{"role": "user", "content": "Say hello."}]
    count = client.messages.count_tokens(model="claude-haiku-4-5-20251001", messages=ask)
    assert count.input_tokens > 0
    # Claude Code's shape: max_tokens 32000, past the model's 8192 tokens, with a thinking
    # budget just below it. The room left may be thousands of tokens: read the first events.
    with client.messages.stream(model="claude-sonnet-4-5-20250929", max_tokens=32000,
                                thinking={"type": "enabled", "budget_tokens": 31999},
                                messages=ask, extra_body={"temperature": 0}) as stream:
        events = []
        for event in stream:
            events.append(event)
            if event.type == "content_block_delta":
                break
    assert events[0].type == "message_start"
    assert events[0].message.model == MODEL
    assert events[-1].type == "content_block_delta"


def test_responses_api_call_then_output_then_text(client: openai.OpenAI) -> None:
    tools = [{"type": "function", "name": t["function"]["name"],
              "description": t["function"]["description"],
              "parameters": t["function"]["parameters"], "strict": True} for t in TOOLS]
    first = client.responses.create(model=MODEL, input=ASK, tools=tools,
                                    tool_choice="required", parallel_tool_calls=False,
                                    temperature=0, max_output_tokens=120)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls, first.output
    _check_call(calls[0].name, calls[0].arguments)
    follow_up: list[Any] = [{"role": "user", "content": ASK}]
    follow_up += [{"type": "function_call", "call_id": c.call_id, "name": c.name,
                   "arguments": c.arguments} for c in calls]
    follow_up += [{"type": "function_call_output", "call_id": c.call_id,
                   "output": json.dumps({"temperature": 21})} for c in calls]
    with client.responses.stream(model=MODEL, input=follow_up, tools=tools,
                                 tool_choice="none", temperature=0,
                                 max_output_tokens=48) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas).strip()
    assert final.output_text == "".join(deltas)


def test_bad_agent_requests_get_400_and_the_server_keeps_serving(
    server: str, client: openai.OpenAI
) -> None:
    url = f"{server}/v1/chat/completions"
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    bad = [
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "dependentSchemas": {"a": {}}}}}},
        {"tools": {"type": "function"}},
    ]
    for extra in bad:
        r = httpx.post(url, json={**base, **extra}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error", r.text
    ok = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=8,
                                        messages=[{"role": "user", "content": "hi"}])
    assert ok.choices[0].message.content


def test_a_schema_no_finite_value_satisfies_is_a_400_saying_why(client: openai.OpenAI) -> None:
    """An object that requires a property of its own kind: every value would nest without
    end, so the answer could never be valid JSON. Refused before any token."""
    nested = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
                              "required": ["c"]}},
              "$ref": "#/$defs/n"}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=40,
            messages=[{"role": "user", "content": "Give a nested object as JSON."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "n", "schema": nested}})
    assert err.value.param == "response_format"
    assert ("no finite JSON value satisfies this schema: $ref '#/$defs/n' → required "
            "property 'c' → $ref '#/$defs/n': a cycle with no way out") in err.value.message


def test_parallel_calls_allowed_each_complete_call_is_valid_and_none_repeats(
    client: openai.OpenAI,
) -> None:
    r = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=150,
                                       messages=[{"role": "user", "content": ASK}],
                                       tools=TOOLS, tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls and choice.message.content is None
    seen = set()
    for call in choice.message.tool_calls:
        args = _check_call(call.function.name, call.function.arguments)
        assert call.id
        key = (call.function.name, json.dumps(args, sort_keys=True))
        assert key not in seen
        seen.add(key)


# A tool whose schema says nothing of other keys (no additionalProperties): the grammar takes
# none but "city".
CITY_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}
ROME = [{"role": "user", "content": "Weather in Rome?"}]


def test_required_call_with_parallel_allowed_is_one_call_ending_with_tool_calls(
    client: openai.OpenAI,
) -> None:
    r = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=200,
                                       messages=ROME, tools=[CITY_WEATHER],
                                       tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert list(json.loads(call.function.arguments)) == ["city"]
    # The answer ended after the call, far before max_tokens.
    assert r.usage.completion_tokens < 100


def test_required_call_streamed_ends_with_one_call_and_tool_calls(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=200, stream=True, messages=ROME,
        tools=[CITY_WEATHER], tool_choice="required"))
    parts = [p for c in chunks if c.choices for p in c.choices[0].delta.tool_calls or ()]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices
                if c.choices[0].finish_reason]
    assert finishes == ["tool_calls"]
    assert {p.index for p in parts} == {0}
    arguments = "".join(p.function.arguments or "" for p in parts if p.function)
    assert list(json.loads(arguments)) == ["city"]
    assert content == ""


def test_named_call_arguments_hold_only_the_declared_keys(client: openai.OpenAI) -> None:
    # Before additionalProperties was read as false, this prompt gave {"city": "Tokyo",
    # "temperature": {"metric": {...}}}.
    for ask in ("What's the weather like in Tokyo in metric units?", "Weather in Rome?"):
        r = client.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=200, tools=[CITY_WEATHER],
            messages=[{"role": "user", "content": ask}],
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        for call in r.choices[0].message.tool_calls:
            assert list(json.loads(call.function.arguments)) == ["city"], ask


def test_a_call_cut_by_max_tokens_is_dropped_and_no_markup_reaches_the_content(
    client: openai.OpenAI,
) -> None:
    for max_tokens in (3, 12):
        r = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=max_tokens,
                                           messages=ROME, tools=[CITY_WEATHER],
                                           tool_choice="required")
        choice = r.choices[0]
        assert choice.finish_reason == "length"
        assert not choice.message.tool_calls
        assert "<" not in (choice.message.content or ""), choice.message.content


def test_anthropic_any_tool_gives_one_tool_use_and_stops_for_it(server: str) -> None:
    client = anthropic.Anthropic(base_url=server, api_key="unused", timeout=300)
    fn = CITY_WEATHER["function"]
    r = client.messages.create(
        model=MODEL, max_tokens=200, messages=ROME, tool_choice={"type": "any"},
        tools=[{"name": fn["name"], "description": fn["description"],
                "input_schema": fn["parameters"]}],
        extra_body={"temperature": 0})
    assert r.stop_reason == "tool_use"
    assert [b.type for b in r.content] == ["tool_use"]
    assert list(r.content[0].input) == ["city"]
