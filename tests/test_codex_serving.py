"""Codex's tools on the real serving stack with the tiny random model (Responses API).

The tiny model's ChatML template has no tool format: its calls come from troupe's fallback
(tools written into the prompt, Hermes markup read back, ``json_tools``) and, when a call is
required, from the grammar, so random weights still write a call that follows a freeform
tool's grammar, escaped inside the call's JSON.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from agent_shapes import APPLY_PATCH
from http_stack import real_client
from llguidance import LLMatcher
from openai.types.responses import Response

from troupe.actors.config import ServeConfig
from troupe.actors.messages import ToolChoice
from troupe.actors.tool_prompt import with_tools_in_prompt
from troupe.api.responses import InputItem, _messages
from troupe.api.responses_tools import tool_set

# A freeform tool whose input is short by its grammar (a random model ends it), with the
# characters JSON escapes: a quote, a backslash, a newline.
SAY_GRAMMAR = 'start: "say \\"" WORD "\\"" LF?\nWORD: /[a-z\\\\]{1,6}/\n%import common.LF\n'
SAY_PATTERN = r'say "[a-z\\]{1,6}"\n?'
SAY = {"type": "custom", "name": "say", "description": "Say a word.",
       "format": {"type": "grammar", "syntax": "lark", "definition": SAY_GRAMMAR}}


async def _client(aiohttp_client: Any, model_dir: Path) -> tuple[Any, str]:
    client, _, handles = await real_client(aiohttp_client, ServeConfig(model=str(model_dir)))
    return client, handles.models[0].id


async def _respond(client: Any, **body: Any) -> Response:
    resp = await client.post("/v1/responses", json=body)
    assert resp.status == 200, await resp.text()
    return Response.model_validate(await resp.json())


async def test_a_required_freeform_call_follows_its_grammar(aiohttp_client, tiny_model_dir):
    client, model = await _client(aiohttp_client, tiny_model_dir)
    for word, parallel in (("fox", False), ("dog", True)):
        response = await _respond(client, model=model, input=f"Say {word}.", tools=[SAY],
                                  tool_choice={"type": "custom", "name": "say"},
                                  parallel_tool_calls=parallel, temperature=1.0,
                                  max_output_tokens=200)
        assert response.status == "completed"
        calls = [item for item in response.output if item.type == "custom_tool_call"]
        assert calls and len(calls) == len(response.output), response.output
        assert parallel or len(calls) == 1
        for call in calls:
            assert call.name == "say" and call.call_id
            assert re.fullmatch(SAY_PATTERN, call.input), call.input


async def test_codexs_apply_patch_call_cut_by_the_token_limit_leaves_no_markup(
    aiohttp_client, tiny_model_dir
):
    """A random model does not finish a patch in a few tokens: the cut call is dropped, and
    nothing of its markup reaches the answer (the grammar's patches are judged whole in
    test_custom_tools and on the default model in test_codex_e2e)."""
    client, model = await _client(aiohttp_client, tiny_model_dir)
    response = await _respond(client, model=model, input="Fix the bug.", tools=[APPLY_PATCH],
                              tool_choice={"type": "custom", "name": "apply_patch"},
                              temperature=1.0, max_output_tokens=120)
    assert response.status == "incomplete"
    assert response.usage is not None and response.usage.output_tokens == 120
    assert response.output_text == ""
    assert not [item for item in response.output if item.type == "custom_tool_call"]


async def test_a_chained_turn_goes_back_as_the_call_the_model_wrote(
    aiohttp_client, tiny_model_dir, grammars
):
    """The second turn continues the first (previous_response_id): the call comes back into
    the prompt as the grammar made the model write it, and the prompt cache serves the
    first turn's prompt."""
    client, model = await _client(aiohttp_client, tiny_model_dir)
    first = await _respond(client, model=model, input="Say fox.", tools=[SAY],
                           tool_choice="required", parallel_tool_calls=False, temperature=0,
                           max_output_tokens=200)
    [call] = [item for item in first.output if item.type == "custom_tool_call"]
    second = await _respond(
        client, model=model, previous_response_id=first.id, tools=[SAY], temperature=0,
        max_output_tokens=4,
        input=[{"type": "custom_tool_call_output", "call_id": call.call_id, "output": "ok"}])
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1
    # The assistant turn the template gets is the text the constrained call is made of.
    items = [InputItem(role="user", content="Say fox."),
             InputItem(type="custom_tool_call", call_id=call.call_id, name="say",
                       input=call.input),
             InputItem(type="custom_tool_call_output", call_id=call.call_id, output="ok")]
    tools = tool_set([_tool(SAY)])
    prompt = with_tools_in_prompt(_messages(None, items), tools.chat)
    written = prompt[2]["content"]
    choice = ToolChoice(mode="function", name="say", input_formats=tools.input_formats)
    ll = grammars.llg_tokenizer()
    constraint = grammars.for_tools(tools.chat, choice, None)
    matcher = LLMatcher(ll, constraint.grammar, log_level=0)
    assert matcher.consume_tokens(ll.tokenize_str(written)) and matcher.is_accepting(), written
    assert written == ('<tool_call>\n{"name": "say", "arguments": '
                       + json.dumps({"input": call.input}, ensure_ascii=False) + "}\n</tool_call>")


# A freeform tool whose grammar lets its input begin "say ", then allows nothing: its rule x
# derives no finite text (each x needs another x before anything).
STUCK = {"type": "custom", "name": "say", "description": "Say a word.",
         "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "say " x\nx: x "!"'}}


async def test_a_required_call_whose_grammar_dead_ends_fails_with_no_call(
    aiohttp_client, tiny_model_dir
):
    """Decoding reaches the grammar's dead end inside the call: the answer is the error (its
    status before any header, the response.failed event in a stream), never a completed
    response without the call."""
    client, model = await _client(aiohttp_client, tiny_model_dir)
    body = dict(model=model, input="Say fox.", tools=[STUCK], temperature=0,
                tool_choice={"type": "custom", "name": "say"}, max_output_tokens=200)
    resp = await client.post("/v1/responses", json=body)
    data = await resp.json()
    assert resp.status == 400, data
    assert "dead end" in data["error"]["message"] and data["error"]["param"] is None
    resp = await client.post("/v1/responses", json={**body, "stream": True})
    assert resp.status == 200
    events = [json.loads(line[len("data: "):]) for line in (await resp.text()).splitlines()
              if line.startswith("data: ")]
    assert events[-1]["type"] == "response.failed", events[-1]
    failed = Response.model_validate(events[-1]["response"])
    assert failed.error is not None and failed.error.code == "invalid_prompt"
    assert "dead end" in failed.error.message
    assert not [item for item in failed.output if item.type == "custom_tool_call"]


def _tool(tool: dict[str, Any]) -> Any:
    from troupe.api.responses_tools import Tool

    return Tool(**tool)
