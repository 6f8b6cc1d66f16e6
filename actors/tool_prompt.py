"""Tools for a model whose chat template has no tool format (the default SmolLM2, say).

Such a template drops ``tools``, the assistant's ``tool_calls`` and the tool results' meaning,
so the model would never learn what it may call nor what a call returned. Here the
conversation is rewritten before the template sees it, in the Hermes convention (the one
Qwen2.5's template writes and mlx-lm's ``json_tools`` parser reads): the tools as JSON in the
system message, each call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in
the assistant's text, each result inside ``<tool_response>`` in a user turn. The answer is
then read with the same format (``actors.engine.agent_output.FALLBACK_TOOL_FORMAT``).
"""

from __future__ import annotations

import json
from typing import Any

CALL_START, CALL_END = "<tool_call>", "</tool_call>"

_INSTRUCTIONS = (
    "# Tools\n\n"
    "You can call functions to help answer. Their signatures, one JSON object a line, are "
    "inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, answer with one JSON object holding its name and arguments inside "
    "<tool_call></tool_call> tags, one block per call:\n"
    '<tool_call>\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n'
    "</tool_call>\n"
    "A function's result comes back to you inside <tool_response></tool_response> tags."
)


def tools_instructions(tools: list[dict[str, Any]]) -> str:
    """The system text that tells the model its tools and how to call them."""
    lines = "\n".join(json.dumps(tool.get("function", tool), ensure_ascii=False)
                      for tool in tools)
    return _INSTRUCTIONS.format(tools=lines)


def render_call(call: dict[str, Any]) -> str:
    """One OpenAI-shaped assistant ``tool_calls`` entry as the model would have written it."""
    function = call.get("function", call)
    arguments: Any = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # kept as the string it was sent as
    body = json.dumps({"name": function.get("name"), "arguments": arguments},
                      ensure_ascii=False)
    return f"{CALL_START}\n{body}\n{CALL_END}"


def with_parsed_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with each earlier call's ``arguments`` as an object: OpenAI clients
    send them as JSON text, and templates that write ``arguments | tojson`` would otherwise
    show the model a quoted string instead of the object it wrote."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [_parsed_call(call) for call in calls]}
        out.append(message)
    return out


def _parsed_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call  # not JSON: the template gets it as it was sent
    return {**call, "function": {**function, "arguments": arguments}}


def uses_tools(messages: list[dict[str, Any]]) -> bool:
    """Whether the conversation holds tool calls or tool results."""
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def _wrapped(content: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A tool's result in its tags; a result holding images (a list of text and image
    parts) stays a list, the tags text parts around it, so the images stay in place."""
    if isinstance(content, list):
        return [{"type": "text", "text": "<tool_response>\n"}, *content,
                {"type": "text", "text": "\n</tool_response>"}]
    return f"<tool_response>\n{content}\n</tool_response>"


def _joined(first: str | list[dict[str, Any]], second: str | list[dict[str, Any]]
            ) -> str | list[dict[str, Any]]:
    """Two tool results in one user turn, a line apart (a list when either holds images)."""
    if isinstance(first, str) and isinstance(second, str):
        return first + "\n" + second

    def parts(c: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{"type": "text", "text": c}] if isinstance(c, str) else list(c)

    return [*parts(first), {"type": "text", "text": "\n"}, *parts(second)]


def with_tools_in_prompt(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The conversation rewritten so that a template without tool support carries the tools,
    the calls and their results as text. Consecutive tool results join one user turn. With
    no tools (hidden by ``tool_choice: none``), only the earlier calls and results."""
    out: list[dict[str, Any]] = []
    if not tools:
        rest = messages
    elif messages and messages[0].get("role") in ("system", "developer"):
        instructions = tools_instructions(tools)
        first = dict(messages[0])
        first["role"] = "system"
        first["content"] = f"{first.get('content') or ''}\n\n{instructions}".lstrip()
        out.append(first)
        rest = messages[1:]
    else:
        out.append({"role": "system", "content": tools_instructions(tools)})
        rest = messages
    for message in rest:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            calls = "\n".join(render_call(call) for call in message["tool_calls"])
            text = message.get("content") or ""
            out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
        elif role == "tool":
            result = _wrapped(message.get("content") or "")
            if out and out[-1].get("tool_results"):
                out[-1]["content"] = _joined(out[-1]["content"], result)
            else:
                out.append({"role": "user", "content": result, "tool_results": True})
        else:
            out.append({key: value for key, value in message.items()
                        if key not in ("tool_calls", "tool_call_id")})
    for message in out:
        message.pop("tool_results", None)
    return out
