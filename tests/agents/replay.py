"""Driving an agent's session through the official clients: each turn's request as the agent
sends it (benchmarks/agent_shapes.py), its stream parsed by the ``anthropic`` or ``openai``
package (a stream they cannot parse fails the turn), and what the agent keeps of it.

``play`` runs a session's turns and returns each turn's ``Answer``; the prefix cache's reuse
of the previous turn's prompt is ``agent_shapes.reuse``.
"""

from __future__ import annotations

import json

import anthropic
import openai
from agent_shapes import AgentSession, Answer, Call, Request

# What the SDK methods take as arguments; the rest of a body goes as it is in extra_body.
_ANTHROPIC_ARGS = ("model", "max_tokens", "messages")


async def anthropic_turn(client: anthropic.AsyncAnthropic, request: Request) -> Answer:
    """One Messages turn, streamed; the SDK assembles the message from the events."""
    body = dict(request.body)
    args = {k: body.pop(k) for k in _ANTHROPIC_ARGS}
    body.pop("stream", None)  # the stream helper sets it
    path, _, query = request.path.partition("?")
    assert path == "/v1/messages", path
    extra_query = dict(part.split("=", 1) for part in query.split("&")) if query else None
    async with client.messages.stream(**args, extra_body=body, extra_headers=request.headers,
                                      extra_query=extra_query) as stream:
        message = await stream.get_final_message()
    answer = Answer(finish=message.stop_reason or "")
    for block in message.content:
        if block.type == "text":
            answer.text += block.text
        elif block.type == "thinking":
            answer.reasoning += block.thinking
        elif block.type == "tool_use":
            answer.calls.append(Call(block.id, block.name, block.input))
    usage = message.usage
    answer.cached_tokens = usage.cache_read_input_tokens or 0
    answer.prompt_tokens = usage.input_tokens + answer.cached_tokens
    return answer


async def chat_turn(client: openai.AsyncOpenAI, request: Request) -> Answer:
    """One chat completion, streamed, its chunks put together as the agent's SDK does."""
    assert request.path == "/v1/chat/completions", request.path
    body = dict(request.body)
    args = {k: body.pop(k) for k in ("model", "messages")}
    body.pop("stream", None)
    stream = await client.chat.completions.create(**args, stream=True, extra_body=body,
                                                  extra_headers=request.headers)
    answer = Answer()
    calls: dict[int, dict[str, str]] = {}
    async for chunk in stream:
        if chunk.usage is not None:
            answer.prompt_tokens = chunk.usage.prompt_tokens
            details = chunk.usage.prompt_tokens_details
            answer.cached_tokens = (details.cached_tokens or 0) if details else 0
        for choice in chunk.choices:
            delta = choice.delta
            answer.text += delta.content or ""
            answer.reasoning += getattr(delta, "reasoning_content", None) or ""
            for part in delta.tool_calls or ():
                call = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
                call["id"] = part.id or call["id"]
                if part.function is not None:
                    call["name"] += part.function.name or ""
                    call["arguments"] += part.function.arguments or ""
            answer.finish = choice.finish_reason or answer.finish
    answer.calls = [Call(c["id"], c["name"], json.loads(c["arguments"] or "{}"))
                    for _, c in sorted(calls.items())]
    return answer


async def responses_turn(client: openai.AsyncOpenAI, request: Request) -> Answer:
    """One Responses turn, streamed; the SDK parses each event."""
    assert request.path == "/v1/responses", request.path
    body = dict(request.body)
    args = {k: body.pop(k) for k in ("model", "input")}
    body.pop("stream", None)
    stream = await client.responses.create(**args, stream=True, extra_body=body,
                                           extra_headers=request.headers)
    # The last event carries the response: completed, or incomplete at max_output_tokens
    # (the SDK's stream helper wants the first only).
    response = None
    async for event in stream:
        if event.type in ("response.completed", "response.incomplete"):
            response = event.response
    assert response is not None, "the stream ended without the response"
    answer = Answer(finish=response.status or "")
    for item in response.output:
        data = item.model_dump(exclude_none=True)
        answer.items.append(data)
        if item.type == "message":
            answer.text += "".join(part.text for part in item.content
                                   if part.type == "output_text")
        elif item.type == "reasoning":
            answer.reasoning += "".join(part.text for part in item.content or ())
        elif item.type == "function_call":
            answer.calls.append(Call(item.call_id, item.name, json.loads(item.arguments)))
        elif item.type == "custom_tool_call":
            answer.calls.append(Call(item.call_id, item.name, item.input))
        elif item.type == "local_shell_call":
            answer.calls.append(Call(item.call_id, "local_shell", data["action"]))
    usage = response.usage
    assert usage is not None
    answer.prompt_tokens = usage.input_tokens
    answer.cached_tokens = usage.input_tokens_details.cached_tokens
    return answer


async def turn(base_url: str, session: AgentSession, request: Request | None = None) -> Answer:
    """``request`` (by default the session's next turn) sent through the official client of
    the agent's API."""
    request = request or session.request()
    if session.route == "/v1/messages":
        async with anthropic.AsyncAnthropic(base_url=base_url, api_key="unused", timeout=600,
                                            max_retries=0) as claude:
            return await anthropic_turn(claude, request)
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=600,
                                  max_retries=0) as client:
        if session.route == "/v1/responses":
            return await responses_turn(client, request)
        return await chat_turn(client, request)


async def play(base_url: str, session: AgentSession, turns: int) -> list[Answer]:
    """``turns`` turns of ``session``: each answer, kept by the session before the next."""
    answers = []
    for _ in range(turns):
        answer = await turn(base_url, session)
        answers.append(answer)
        session.take(answer)
    return answers
