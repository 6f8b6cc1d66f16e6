"""End to end: Codex CLI's Responses requests against the bundled default model, through the
official ``openai`` client.

The requests are shaped as codex-rs sends them (benchmarks/agent_shapes.py): instructions, a
developer message, the environment context, tools (a ``shell`` function, ``update_plan``, the
``apply_patch`` freeform tool with Codex's Lark grammar, a hosted ``web_search``), streamed,
``store: false``, encrypted reasoning asked for, a prompt cache key. SmolLM2-135M has no tool
format: its calls come from troupe's fallback, and a required apply_patch call is forced to
be a patch by the grammar.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
from agent_shapes import (
    APPLY_PATCH,
    APPLY_PATCH_GRAMMAR,
    DEVELOPER,
    ENVIRONMENT,
    message,
    turn_fields,
)
from llguidance import LLMatcher

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
ASK = "Create the file hello.txt holding one line: Hello."
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+Hello\n*** End Patch\n"


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=300)


def is_patch(text: str) -> bool:
    """Whether ``text`` is a sentence of Codex's apply_patch grammar (llguidance's reading)."""
    from mlx_lm.utils import load_tokenizer

    from troupe.actors.engine.grammar import Grammars
    from troupe.actors.models.store import resolve_model

    ll = Grammars(load_tokenizer(resolve_model(None).path)).llg_tokenizer()
    matcher = LLMatcher(ll, LLMatcher.grammar_from_lark(APPLY_PATCH_GRAMMAR), log_level=0)
    return matcher.consume_tokens(ll.tokenize_str(text)) and matcher.is_accepting()


def first_turn() -> list[dict[str, Any]]:
    return [message("developer", DEVELOPER), message("user", ENVIRONMENT), message("user", ASK)]


def stream_turn(client: openai.OpenAI, items: list[dict[str, Any]]) -> tuple[Any, list[Any]]:
    """One streamed Codex turn: the final response and the event types, with its headers
    checked (the hosted web_search was dropped, and said so)."""
    fields: Any = turn_fields(max_output_tokens=96, temperature=0)
    with client.responses.with_streaming_response.create(model=MODEL, input=items,
                                                         **fields) as raw:
        assert raw.status_code == 200
        assert "dropped: web_search" in raw.headers["warning"]
        events = list(raw.parse())
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete"), last
    return last.response, [event.type for event in events]


def test_a_codex_turn_is_answered_and_read_by_the_sdk(client: openai.OpenAI) -> None:
    response, kinds = stream_turn(client, first_turn())
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert response.store is False
    assert [tool.type for tool in response.tools] == ["function", "function", "custom"]
    assert response.output, response
    for item in response.output:
        assert item.type in ("message", "function_call", "custom_tool_call"), item
    # store: false: nothing to continue.
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_a_second_codex_turn_sends_back_reasoning_a_patch_and_its_output(
    client: openai.OpenAI,
) -> None:
    items = [
        *first_turn(),
        {"type": "reasoning", "id": "rs_1", "summary": [
            {"type": "summary_text", "text": "**Creating the file**"}],
         "content": None, "encrypted_content": "gAAAAABopaque=="},
        {"type": "custom_tool_call", "id": "ctc_1", "status": "completed",
         "call_id": "call_1", "name": "apply_patch", "input": PATCH},
        {"type": "custom_tool_call_output", "call_id": "call_1",
         "output": '{"output":"Success. Updated the following files:\\nA hello.txt\\n",'
                   '"metadata":{"exit_code":0,"duration_seconds":0.0}}'},
        message("user", "Now say what you did."),
    ]
    response, kinds = stream_turn(client, items)
    assert "response.output_item.done" in kinds
    assert response.usage.input_tokens > 0


def test_a_required_apply_patch_call_is_a_valid_patch(client: openai.OpenAI) -> None:
    fields: Any = turn_fields(stream=False, temperature=0, max_output_tokens=300)
    fields["tool_choice"] = {"type": "custom", "name": "apply_patch"}
    response = client.responses.create(model=MODEL, input=first_turn(), **fields)
    calls = [item for item in response.output if item.type == "custom_tool_call"]
    assert response.status == "completed", response.output
    assert calls and all(call.name == "apply_patch" for call in calls), response.output
    for call in calls:
        assert is_patch(call.input), call.input


def test_a_required_apply_patch_call_streams_in_codexs_events(client: openai.OpenAI) -> None:
    tools: Any = [APPLY_PATCH]
    with client.responses.stream(model=MODEL, input=ASK, tools=tools, temperature=0,
                                 tool_choice={"type": "custom", "name": "apply_patch"},
                                 parallel_tool_calls=False, max_output_tokens=300) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[-5:] == ["response.output_item.added", "response.custom_tool_call_input.delta",
                          "response.custom_tool_call_input.done", "response.output_item.done",
                          "response.completed"]
    [call] = final.output
    assert call.type == "custom_tool_call" and is_patch(call.input), call


def test_a_chained_turn_continues_the_stored_response_from_the_cache(
    client: openai.OpenAI,
) -> None:
    rules = "Answer briefly."  # sent again: instructions are not carried over
    first = client.responses.create(model=MODEL, input=first_turn(), instructions=rules,
                                    temperature=0, max_output_tokens=24)
    assert first.store is True
    second = client.responses.create(model=MODEL, previous_response_id=first.id,
                                     instructions=rules, input="And then?", temperature=0,
                                     max_output_tokens=24)
    assert second.previous_response_id == first.id
    assert first.usage is not None and second.usage is not None
    # The first turn's prompt starts the second's: the prefix cache serves it (up to the
    # part of a block it may leave to prefill).
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 64
    assert client.responses.retrieve(second.id).output_text == second.output_text
