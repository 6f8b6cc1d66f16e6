"""The Responses API's tools as chat functions, and the model's calls back as Responses items.

Codex CLI sends three kinds of tools besides functions, and this module maps each both ways
(an answer's call becomes the item of its tool's kind; that item, sent back in ``input``,
becomes the same call in the prompt, so the prompt holds what the model wrote):

- ``custom`` (freeform): the function of its name taking one string, ``input`` (as llama.cpp
  does), its description followed by its grammar when it has one (the only way a model learns
  the format). A call is a ``custom_tool_call`` whose ``input`` is that string. When the call
  is enforced, the string follows the grammar (``ToolChoice.input_formats``).
- ``local_shell``: the function ``local_shell`` taking Codex's exec action (``command``,
  ``working_directory``, ``timeout_ms``); a call is a ``local_shell_call``.
- hosted tools this server cannot run (``web_search``, ``file_search``, ``code_interpreter``,
  ``image_generation``, ``computer_use_preview``, ``mcp``...): left out, and named in a
  warning the client sees.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import msgspec

from troupe.actors.messages import OutputFormat
from troupe.api.errors import ApiError

INPUT = "input"  # a freeform tool's one argument (actors.engine.custom_tools.INPUT)
LOCAL_SHELL = "local_shell"

_FREEFORM_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {INPUT: {"type": "string"}},
    "required": [INPUT],
    "additionalProperties": False,
}
# Codex's LocalShellExecAction (codex-rs/protocol/src/models.rs), the fields a model fills.
_LOCAL_SHELL_FIELDS = ("command", "working_directory", "timeout_ms")
_LOCAL_SHELL_FUNCTION: dict[str, Any] = {
    "name": LOCAL_SHELL,
    "description": "Run a command on the user's machine. Its output comes back as the result.",
    "parameters": {
        "type": "object",
        "properties": {
            "command": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                        "description": "The program and its arguments, e.g. [\"ls\", \"-la\"]."},
            "working_directory": {"type": "string",
                                  "description": "The directory to run it in."},
            "timeout_ms": {"type": "integer", "minimum": 1,
                           "description": "Stop it after this many milliseconds."},
        },
        "required": ["command"],
        "additionalProperties": False,
    },
}


class Tool(msgspec.Struct, kw_only=True):
    # Any type decodes, so that a hosted tool (web_search...) is dropped, not refused.
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    # A custom tool's: {"type": "text"} or {"type": "grammar", "syntax", "definition"}.
    format: dict[str, Any] | None = None


@dataclass
class ToolSet:
    """A request's tools as the chat template gets them, and what mapping the calls back
    needs."""

    chat: list[dict[str, Any]] = field(default_factory=list)  # OpenAI chat functions
    echo: list[dict[str, Any]] = field(default_factory=list)  # the tools the response repeats
    functions: set[str] = field(default_factory=set)
    freeform: set[str] = field(default_factory=set)
    local_shell: bool = False
    # A freeform tool's grammar (lark or regex) by name; its index in the request's tools.
    input_formats: dict[str, OutputFormat] = field(default_factory=dict)
    index: dict[str, int] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)  # the types of the tools left out


def tool_set(tools: list[Tool]) -> ToolSet:
    """The request's tools, mapped; a malformed function or custom tool is a 400."""
    out = ToolSet()
    for i, tool in enumerate(tools):
        if tool.type == LOCAL_SHELL:
            out.chat.append({"type": "function", "function": dict(_LOCAL_SHELL_FUNCTION)})
            out.echo.append({"type": LOCAL_SHELL})
            out.local_shell = True
            out.index[LOCAL_SHELL] = i
            continue
        if tool.type not in ("function", "custom"):
            out.dropped.append(tool.type)
            continue
        if not tool.name:
            raise ApiError(400, f"A {tool.type} tool needs a 'name'.", param=f"tools[{i}].name")
        function: dict[str, Any] = {"name": tool.name}
        if tool.type == "function":
            if tool.description is not None:
                function["description"] = tool.description
            function["parameters"] = tool.parameters or {"type": "object", "properties": {}}
            out.functions.add(tool.name)
            out.echo.append({"type": "function", "name": tool.name,
                             "description": tool.description, "parameters": tool.parameters,
                             "strict": tool.strict})
        else:
            fmt = _freeform_format(tool.format, f"tools[{i}].format")
            description = _described(tool.description, fmt)
            if description:
                function["description"] = description
            function["parameters"] = _FREEFORM_PARAMETERS
            out.freeform.add(tool.name)
            if fmt is not None:
                out.input_formats[tool.name] = fmt
            echo: dict[str, Any] = {"type": "custom", "name": tool.name}
            if tool.description is not None:
                echo["description"] = tool.description
            if tool.format is not None:
                echo["format"] = tool.format
            out.echo.append(echo)
        out.chat.append({"type": "function", "function": function})
        out.index[tool.name] = i
    return out


def _freeform_format(fmt: dict[str, Any] | None, param: str) -> OutputFormat | None:
    """A custom tool's grammar as an ``OutputFormat`` (``lark`` or ``regex``); None for text."""
    if fmt is None or fmt.get("type") == "text":
        return None
    syntax, definition = fmt.get("syntax"), fmt.get("definition")
    if fmt.get("type") != "grammar" or syntax not in ("lark", "regex"):
        raise ApiError(400, "A custom tool's format is {\"type\": \"text\"} or {\"type\": "
                       "\"grammar\", \"syntax\": \"lark\" | \"regex\", \"definition\"}.",
                       param=param)
    if not isinstance(definition, str) or not definition:
        raise ApiError(400, "A grammar format needs its 'definition'.",
                       param=f"{param}.definition")
    return OutputFormat(type=syntax, pattern=definition)


def _described(description: str | None, fmt: OutputFormat | None) -> str | None:
    """A freeform tool's description, with its grammar: all the model learns of the format."""
    if fmt is None:
        return description
    kind = "this Lark grammar" if fmt.type == "lark" else "this regular expression"
    line = f"The input is text in {kind}:\n{fmt.pattern}"
    return f"{description}\n\n{line}" if description else line


# --- calls out: the engine's calls as items ------------------------------------------------


def freeform_input(arguments: str) -> str:
    """A freeform call's input: the ``input`` string the model wrote, or (other keys, not a
    string) its whole arguments as JSON text rather than lose them."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(parsed, dict) and set(parsed) == {INPUT} and isinstance(parsed[INPUT], str):
        return parsed[INPUT]
    return arguments


def local_shell_action(arguments: str) -> dict[str, Any] | None:
    """A ``local_shell`` call's exec action, as Codex reads it; None when the arguments are
    not one (it then goes out as a function call, nothing lost)."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return None
    if not isinstance(parsed, dict):
        return None
    command = parsed.get("command")
    directory = parsed.get("working_directory", parsed.get("workdir"))
    timeout = parsed.get("timeout_ms")
    if (not isinstance(command, list) or not command
            or not all(isinstance(part, str) for part in command)
            or not isinstance(directory, str | None)
            or not (timeout is None or isinstance(timeout, int) and not isinstance(timeout, bool))):
        return None
    return {"type": "exec", "command": command, "timeout_ms": timeout,
            "working_directory": directory, "env": {}, "user": None}


# --- calls in: earlier items as the calls the model wrote ----------------------------------


def freeform_arguments(text: str) -> str:
    """A freeform call's input as the arguments the model wrote (the engine's JSON)."""
    return json.dumps({INPUT: text}, ensure_ascii=False)


def local_shell_arguments(action: Any, where: str) -> str:
    """A ``local_shell_call``'s action as the arguments the model wrote."""
    if not isinstance(action, dict) or action.get("type", "exec") != "exec":
        raise ApiError(400, "A local_shell_call needs an 'action' of type 'exec'.",
                       param=f"{where}.action")
    command = action.get("command")
    if not isinstance(command, list) or not all(isinstance(part, str) for part in command):
        raise ApiError(400, "A local_shell_call's 'command' is a list of strings.",
                       param=f"{where}.action.command")
    arguments = {name: action[name] for name in _LOCAL_SHELL_FIELDS
                 if action.get(name) is not None}
    return json.dumps(arguments, ensure_ascii=False)
