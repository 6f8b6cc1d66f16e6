"""What coding agents send, turn after turn: Claude Code, Codex CLI, OpenCode and Cline.

Each agent is an ``AgentSession``: it builds every turn's request (path, headers, JSON body)
from the conversation so far, in the shape that agent sends it, and takes the server's answer
(``Answer``: text, reasoning, tool calls, usage) the way that agent keeps it: the assistant's
turn as received, then the agent's next input (a result for each call it made, or the user's
next message). The shapes are written from the agents' public sources and published captures
of their traffic; each class says which, and what of it it keeps. Used by the replay suite
(tests/agents/) and by benchmarks/agents_replay.py.

What the user and the tools say comes from a ``Script``: deterministic text from a seed, so
every server and every run gets the same conversation (as far as the answers let it: the
model's own calls decide which results follow).
"""

from __future__ import annotations

import json
import random
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

# --- what every agent's turn is made of -----------------------------------------------------


@dataclass
class Call:
    """One tool call of an answer: its id, the tool's name and what it was given (the
    arguments object of a function tool; the text of a Codex freeform tool)."""

    id: str
    name: str
    input: Any


@dataclass
class Answer:
    """What the agent kept of one answer, and the usage the server reported for it."""

    text: str = ""
    reasoning: str = ""
    calls: list[Call] = field(default_factory=list)
    prompt_tokens: int = 0  # every prompt token, those read from the cache included
    cached_tokens: int = 0
    finish: str = ""  # the finish reason in the API's own words
    # The Responses API's output items as they came (Codex sends them back as they are).
    items: list[dict[str, Any]] = field(default_factory=list)
    signature: str = ""  # an Anthropic thinking block's signature, as the server sent it


@dataclass(frozen=True)
class Request:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


def reuse(previous: Answer, current: Answer) -> float:
    """Of the previous turn's prompt, the share this turn read from the prefix cache."""
    if previous.prompt_tokens <= 0:
        return 0.0
    return min(current.cached_tokens, previous.prompt_tokens) / previous.prompt_tokens


class AgentSession(ABC):
    """One agent's conversation with a server."""

    name: str
    route: str  # the API route the agent speaks

    @abstractmethod
    def request(self) -> Request:
        """The next turn's request."""

    @abstractmethod
    def take(self, answer: Answer) -> None:
        """Keep ``answer`` as the agent does, and make the agent's next input."""

    @abstractmethod
    def scripted(self, turn: int) -> Answer:
        """An answer written by the script in this agent's terms (a line and one call of its
        own tools), for replays that give every server the same conversation."""


# --- the script: what the user asks and what the tools answer --------------------------------

WORDS = ("parser scheduler cache block token request batch stream queue worker index writer "
         "config handler router session buffer socket payload schema decoder encoder retry "
         "timeout budget metric counter snapshot manifest layer kernel shard lease lock "
         "channel future callback registry plugin adapter fixture migration commit").split()
FILES = ("src/server.py src/scheduler.py src/cache.py src/mailbox.py tests/test_cache.py "
         "docs/design.md src/engine/core.py src/api/routes.py").split()
TASKS = (
    "The cache tests fail since the last merge. Find out why and fix it.",
    "Add a --timeout flag to the server and document it.",
    "Rename the scheduler's queue to waiting everywhere, tests included.",
    "Why does the writer drop blocks under load? Look and explain.",
    "Make the mailbox bounded and add a test that fills it.",
    "Split routes.py into one module per API and keep the imports working.",
)


class Script:
    """The user's tasks and the tools' results, made from ``seed``: a result is sized in
    [``result_chars``] characters (about 4 a token), code-like or log-like text."""

    def __init__(self, seed: int = 0, result_chars: tuple[int, int] = (600, 2400)) -> None:
        self.rng = random.Random(seed)
        self.result_chars = result_chars
        self.tasks = 0

    def word(self) -> str:
        return self.rng.choice(WORDS)

    def ident(self) -> str:
        return f"{self.word()}_{self.word()}{self.rng.randint(0, 99)}"

    def task(self) -> str:
        text = TASKS[self.tasks % len(TASKS)]
        self.tasks += 1
        return text

    def path(self) -> str:
        return self.rng.choice(FILES)

    def result(self, name: str) -> str:
        """A tool's output: a file's lines, search hits, or a command's log."""
        n = self.rng.randint(*self.result_chars)
        lines: list[str] = []
        kind = self.rng.choice(("code", "hits", "log")) if name else "log"
        while sum(map(len, lines)) < n:
            if kind == "code":
                lines += [f"def {self.ident()}({self.word()}: int) -> bool:",
                          f"    return self.{self.ident()}({self.word()} - "
                          f"{self.rng.randint(1, 64)})"]
            elif kind == "hits":
                lines.append(f"{self.path()}:{self.rng.randint(1, 900)}:    self.{self.ident()}"
                             f" = {self.ident()}()")
            else:
                status = self.rng.choice(["PASSED"] * 5 + ["FAILED"])
                lines.append(f"tests/test_{self.word()}.py::test_{self.ident()} {status}")
        return "\n".join(lines)

    def filler(self, n_chars: int) -> str:
        """Instruction-like prose of about ``n_chars`` characters (a system prompt's body)."""
        out: list[str] = []
        while sum(map(len, out)) < n_chars:
            out.append(f"When you {self.rng.choice(['change', 'read', 'test', 'explain'])} the "
                       f"{self.word()} {self.word()}, keep `{self.ident()}` under "
                       f"{self.rng.randint(2, 900)} ms and say why in one line. ")
        return "".join(out)


def _hex(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789abcdef") for _ in range(n))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


# --- Claude Code ----------------------------------------------------------------------------


def _cc_tool(name: str, description: str, props: dict[str, Any], required: list[str]
             ) -> dict[str, Any]:
    # Claude Code's input schemas come from zod: draft-07, no key it did not declare.
    return {"name": name, "description": description, "input_schema": {
        "type": "object", "properties": props, "required": required,
        "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"}}


_S = {"type": "string"}
CLAUDE_CODE_TOOLS = [
    _cc_tool("Task", "Launch a new agent to handle complex, multi-step tasks autonomously.",
             {"description": {**_S, "description": "A short (3-5 word) description"},
              "prompt": {**_S, "description": "The task for the agent to perform"},
              "subagent_type": {**_S, "description": "The type of agent to use"}},
             ["description", "prompt", "subagent_type"]),
    _cc_tool("Bash", "Executes a given bash command in a persistent shell session.",
             {"command": {**_S, "description": "The command to execute"},
              "timeout": {"type": "number", "description": "Optional timeout in milliseconds"},
              "description": {**_S, "description": "What this command does in 5-10 words"},
              "run_in_background": {"type": "boolean"}}, ["command"]),
    _cc_tool("Glob", "Fast file pattern matching tool that works with any codebase size.",
             {"pattern": {**_S, "description": "The glob pattern to match files against"},
              "path": {**_S, "description": "The directory to search in"}}, ["pattern"]),
    _cc_tool("Grep", "A powerful search tool built on ripgrep.",
             {"pattern": _S, "path": _S, "glob": _S,
              "output_mode": {"type": "string",
                              "enum": ["content", "files_with_matches", "count"]},
              "-n": {"type": "boolean"}, "-i": {"type": "boolean"}}, ["pattern"]),
    _cc_tool("ExitPlanMode", "Use this tool when you are in plan mode and have finished.",
             {"plan": {**_S, "description": "The plan you came up with"}}, ["plan"]),
    _cc_tool("Read", "Reads a file from the local filesystem.",
             {"file_path": {**_S, "description": "The absolute path to the file to read"},
              "offset": {"type": "number"}, "limit": {"type": "number"}}, ["file_path"]),
    _cc_tool("Edit", "Performs exact string replacements in files.",
             {"file_path": _S, "old_string": _S, "new_string": _S,
              "replace_all": {"type": "boolean", "default": False}},
             ["file_path", "old_string", "new_string"]),
    _cc_tool("MultiEdit", "Makes multiple edits to a single file in one operation.",
             {"file_path": _S, "edits": {"type": "array", "minItems": 1, "items": {
                 "type": "object", "properties": {"old_string": _S, "new_string": _S},
                 "required": ["old_string", "new_string"], "additionalProperties": False}}},
             ["file_path", "edits"]),
    _cc_tool("Write", "Writes a file to the local filesystem.",
             {"file_path": _S, "content": _S}, ["file_path", "content"]),
    _cc_tool("NotebookEdit", "Replaces the contents of a specific cell in a Jupyter notebook.",
             {"notebook_path": _S, "cell_id": _S, "new_source": _S,
              "edit_mode": {"type": "string", "enum": ["replace", "insert", "delete"]}},
             ["notebook_path", "new_source"]),
    _cc_tool("WebFetch", "Fetches content from a specified URL and processes it.",
             {"url": {"type": "string", "format": "uri"}, "prompt": _S}, ["url", "prompt"]),
    _cc_tool("TodoWrite", "Create and manage a structured task list for your session.",
             {"todos": {"type": "array", "items": {
                 "type": "object", "properties": {
                     "content": {"type": "string", "minLength": 1},
                     "status": {"type": "string",
                                "enum": ["pending", "in_progress", "completed"]},
                     "activeForm": {"type": "string", "minLength": 1}},
                 "required": ["content", "status", "activeForm"],
                 "additionalProperties": False}}}, ["todos"]),
    _cc_tool("WebSearch", "Allows Claude to search the web.",
             {"query": {"type": "string", "minLength": 2},
              "allowed_domains": {"type": "array", "items": _S}}, ["query"]),
    _cc_tool("BashOutput", "Retrieves output from a running or completed background shell.",
             {"bash_id": _S, "filter": _S}, ["bash_id"]),
    _cc_tool("KillShell", "Kills a running background bash shell by its ID.",
             {"shell_id": _S}, ["shell_id"]),
]

CLAUDE_CODE_IDENTITY = "You are Claude Code, Anthropic's official CLI for Claude."


class ClaudeCode(AgentSession):
    """Claude Code (2.1.x) against ``ANTHROPIC_BASE_URL``: ``POST /v1/messages?beta=true``.

    From captures of its traffic (qntx.sbvh.nl/research/claude-api-wire-format, 2.1.69;
    claudish's PROTOCOL_SPECIFICATION, 2.0.x) and Claude Code's own issue #68900: headers
    ``anthropic-version``, ``anthropic-beta``, ``x-app: cli``, a ``claude-cli/`` user agent;
    ``system`` as blocks, the first ``x-anthropic-billing-header: cc_version=...;
    cc_entrypoint=cli; cch=<5 hex>;`` with a new hash (and version suffix) on every request,
    then the identity line, then the instructions with ``cache_control``; tools with
    draft-07 schemas; ``metadata.user_id`` naming user, account and session; ``max_tokens``
    32000 with ``thinking`` ``enabled`` at 31999, or (2.1.69) ``adaptive`` with
    ``context_management`` and ``output_config.effort`` and their betas; always streamed.
    User turns are block lists: ``<system-reminder>`` text, the task or the
    ``tool_result`` blocks (content as text blocks, ``is_error``); assistant turns are sent
    back as received (thinking with its signature, text, tool_use), and the last block of the
    last message carries ``cache_control`` (it moves every turn)."""

    name = "claude-code"
    route = "/v1/messages"

    def __init__(self, script: Script, *, model: str = "claude-sonnet-4-6",
                 system_chars: int = 6000, thinking: str | None = "enabled",
                 version: str = "2.1.37", resumed: int = 0) -> None:
        self.script = script
        self.model = model
        self.version = version
        self.thinking = thinking
        rng = script.rng
        self.user_id = (f"user_{_hex(rng, 64)}_account_{_uuid(rng)}"
                        f"_session_{_uuid(rng)}")
        self.instructions = ("You are an interactive CLI tool that helps users with software "
                             "engineering tasks.\n\n# Doing tasks\n" + script.filler(system_chars))
        self.messages: list[dict[str, Any]] = [self._user_turn(script.task())]
        self.tools = CLAUDE_CODE_TOOLS
        for i in range(resumed):  # a session resumed (--resume) or grown before this point
            calls = [Call(f"toolu_{_hex(rng, 24)}", "Read",
                          {"file_path": "/home/u/proj/" + script.path()})]
            if i % 2:  # two calls in one turn, the second failing (see ``take``)
                calls.append(Call(f"toolu_{_hex(rng, 24)}", "Grep", {"pattern": script.word()}))
            self.take(Answer(text="Let me read the file first.", calls=calls,
                             reasoning="The task names a file; I should read it." if i else ""))

    # A signature as Anthropic's API gives one (base64); a server that has none sends "".
    SIGNATURE = "EqQBCkYIBxgCKkBtcm9ja2VkLXNpZ25hdHVyZS1mb3ItcmVwbGF5"

    def _reminder(self) -> dict[str, Any]:
        return {"type": "text", "text": "<system-reminder>\nAs you answer the user's "
                "questions, you can use the following context:\n# claudeMd\nKeep commits "
                "small.\n</system-reminder>"}

    def _user_turn(self, text: str) -> dict[str, Any]:
        return {"role": "user", "content": [self._reminder(), {"type": "text", "text": text}]}

    def _billing(self) -> str:
        rng = self.script.rng
        return (f"x-anthropic-billing-header: cc_version={self.version}.{_hex(rng, 3)}; "
                f"cc_entrypoint=cli; cch={_hex(rng, 5)};")

    def headers(self) -> dict[str, str]:
        betas = "claude-code-20250219,interleaved-thinking-2025-05-14,"
        betas += ("adaptive-thinking-2026-01-28,context-management-2025-06-27,"
                  "effort-2025-11-24" if self.thinking == "adaptive"
                  else "fine-grained-tool-streaming-2025-05-14")
        return {"anthropic-version": "2023-06-01", "anthropic-beta": betas,
                "x-app": "cli", "user-agent": f"claude-cli/{self.version} (external, cli)",
                "anthropic-dangerous-direct-browser-access": "true"}

    def system(self) -> list[dict[str, Any]]:
        return [{"type": "text", "text": self._billing()},
                {"type": "text", "text": CLAUDE_CODE_IDENTITY,
                 "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": self.instructions,
                 "cache_control": {"type": "ephemeral"}}]

    def _marked(self) -> list[dict[str, Any]]:
        """The messages with ``cache_control`` on the last block of the last one."""
        messages = json.loads(json.dumps(self.messages))
        last = messages[-1]["content"]
        last[-1] = {**last[-1], "cache_control": {"type": "ephemeral"}}
        return messages

    def request(self) -> Request:
        body: dict[str, Any] = {
            "model": self.model, "max_tokens": 32000, "messages": self._marked(),
            "system": self.system(), "tools": self.tools,
            "metadata": {"user_id": self.user_id}, "temperature": 1, "stream": True,
        }
        if self.thinking == "enabled":
            body["thinking"] = {"type": "enabled", "budget_tokens": 31999}
        elif self.thinking == "adaptive":
            body["thinking"] = {"type": "adaptive"}
            body["context_management"] = {"edits": [{"type": "clear_thinking_20251015",
                                                     "keep": "all"}]}
            body["output_config"] = {"effort": "medium"}
        return Request("/v1/messages?beta=true", self.headers(), body)

    def take(self, answer: Answer) -> None:
        blocks: list[dict[str, Any]] = []
        if answer.reasoning:
            blocks.append({"type": "thinking", "thinking": answer.reasoning,
                           "signature": answer.signature or self.SIGNATURE})
        if answer.text:
            blocks.append({"type": "text", "text": answer.text})
        blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.input}
                   for c in answer.calls]
        if not blocks:
            blocks = [{"type": "text", "text": ""}]
        self.messages.append({"role": "assistant", "content": blocks})
        if not answer.calls:
            self.messages.append(self._user_turn(self.script.task()))
            return
        results: list[dict[str, Any]] = []
        for i, call in enumerate(answer.calls):
            failed = i == 1  # a second call in one turn fails, as tools sometimes do
            results.append({"type": "tool_result", "tool_use_id": call.id, "is_error": failed,
                            "content": [{"type": "text", "text": (
                                "<tool_use_error>File has not been read yet.</tool_use_error>"
                                if failed else self.script.result(call.name))}]})
        self.messages.append({"role": "user", "content": [*results, self._reminder()]})

    def scripted(self, turn: int) -> Answer:
        tool, given = [("Read", {"file_path": f"/home/u/proj/{self.script.path()}"}),
                       ("Grep", {"pattern": self.script.word(), "output_mode": "content"}),
                       ("Bash", {"command": "pytest -x -q", "description": "Run the tests"}),
                       ][turn % 3]
        return Answer(text=f"Step {turn}: let me check the {self.script.word()}.",
                      calls=[Call(f"toolu_{self.script.ident()}{turn:03d}", tool, given)])

    def quota_probe(self) -> Request:
        """The small job Claude Code runs at start on its haiku model."""
        return Request("/v1/messages?beta=true", self.headers(), {
            "model": "claude-haiku-4-5-20251001", "max_tokens": 1,
            "messages": [{"role": "user", "content": "quota"}],
            "metadata": {"user_id": self.user_id}})

    def count_tokens(self) -> Request:
        """``/v1/messages/count_tokens`` for the conversation so far (its context meter)."""
        return Request("/v1/messages/count_tokens?beta=true", self.headers(), {
            "model": self.model, "messages": self.messages, "system": self.system(),
            "tools": self.tools})

    def compact(self, summary: str) -> None:
        """Claude Code near the context's end: the history becomes one summary message."""
        self.messages = [self._user_turn(
            "This session is being continued from a previous conversation that ran out of "
            "context. The conversation is summarized below:\n" + summary)]


# --- Codex CLI ------------------------------------------------------------------------------
# Read from codex-rs (openai/codex): the apply_patch freeform tool and its Lark grammar
# (codex-rs/core/src/tools/handlers/tool_apply_patch.lark, codex-rs/tools/src/apply_patch_tool.rs),
# the request body (codex-rs/codex-api/src/common.rs ``ResponsesApiRequest``), and the items
# sent back (codex-rs/protocol/src/models.rs ``ResponseItem``).

APPLY_PATCH_GRAMMAR = """start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

filename: /(.+)/
add_line: "+" /(.*)/ LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF

%import common.LF
"""

APPLY_PATCH: dict[str, Any] = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Use the `apply_patch` tool to edit files. This is a FREEFORM tool, so do "
    "not wrap the patch in JSON.",
    "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_GRAMMAR},
}
SHELL: dict[str, Any] = {
    "type": "function",
    "name": "shell",
    "description": "Runs a shell command and returns its output.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {
            "command": {"type": "array", "items": {"type": "string"},
                        "description": "The command to execute"},
            "workdir": {"type": "string", "description": "The working directory"},
            "timeout_ms": {"type": "number", "description": "The timeout in milliseconds"},
        },
        "required": ["command"],
        "additionalProperties": False,
    },
}
UPDATE_PLAN: dict[str, Any] = {
    "type": "function",
    "name": "update_plan",
    "description": "Updates the task plan.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {
            "explanation": {"type": "string"},
            "plan": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"step": {"type": "string"},
                                   "status": {"type": "string",
                                              "enum": ["pending", "in_progress", "completed"]}},
                    "required": ["step", "status"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["plan"],
        "additionalProperties": False,
    },
}
WEB_SEARCH: dict[str, Any] = {"type": "web_search", "external_web_access": False}
TOOLS = [SHELL, UPDATE_PLAN, APPLY_PATCH, WEB_SEARCH]

INSTRUCTIONS = "You are Codex, a coding agent. Use apply_patch to edit files."
DEVELOPER = "<permissions instructions>Approval policy: never.</permissions instructions>"
ENVIRONMENT = ("<environment_context>\n  <cwd>/work/demo</cwd>\n  <shell>bash</shell>\n"
               "</environment_context>")


def message(role: str, text: str) -> dict[str, Any]:
    """A message item as Codex writes one (input_text parts)."""
    kind = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


def turn_fields(**extra: Any) -> dict[str, Any]:
    """The fields Codex sends on every turn besides model and input."""
    return {
        "instructions": INSTRUCTIONS,
        "tools": TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199a7c5-session",
        "text": {"verbosity": "medium"},
        **extra,
    }


class Codex(AgentSession):
    """Codex CLI with a provider of ``wire_api = "responses"``: ``POST /v1/responses``.

    As codex-rs sends it (above): ``instructions``; ``input`` opening with a developer
    message (permissions), the AGENTS.md instructions and the ``<environment_context>`` as
    user messages, then the task; tools ``shell``, ``update_plan``, the ``apply_patch``
    freeform tool with its Lark grammar, a hosted ``web_search``; ``tool_choice`` auto,
    ``store: false`` (so every turn sends the whole history), encrypted reasoning asked for,
    a ``prompt_cache_key`` per conversation. Each answer's output items go back as they came
    (reasoning with its ``encrypted_content``, messages, calls), followed by a
    ``function_call_output`` or ``custom_tool_call_output`` for each call."""

    name = "codex"
    route = "/v1/responses"

    def __init__(self, script: Script, *, model: str = "gpt-5-codex", resumed: int = 0
                 ) -> None:
        self.script = script
        self.model = model
        self.session = _uuid(script.rng)
        self.input: list[dict[str, Any]] = [
            message("developer", DEVELOPER),
            message("user", "# AGENTS.md instructions for /work/demo\n\n<INSTRUCTIONS>\n"
                            + script.filler(400) + "\n</INSTRUCTIONS>"),
            message("user", ENVIRONMENT),
            message("user", script.task()),
        ]
        for i in range(resumed):
            reasoning = {"type": "reasoning", "id": f"rs_{_hex(script.rng, 16)}", "summary": [
                {"type": "summary_text", "text": "**Looking at the code**"}],
                "encrypted_content": "gAAAAAB" + _hex(script.rng, 64)}
            call = (Call(f"call_{_hex(script.rng, 24)}", "apply_patch",
                         "*** Begin Patch\n*** Add File: notes.txt\n+done\n*** End Patch\n")
                    if i % 2 else
                    Call(f"call_{_hex(script.rng, 24)}", "shell",
                         {"command": ["bash", "-lc", f"rg -n {script.word()}"],
                          "workdir": "/work/demo"}))
            self.take(Answer(calls=[call], items=[reasoning, _call_item(call)]))

    def request(self) -> Request:
        return Request(self.route, {"originator": "codex_cli_rs", "session_id": self.session},
                       {"model": self.model, "input": self.input,
                        **turn_fields(prompt_cache_key=self.session)})

    def scripted(self, turn: int) -> Answer:
        return _codex_scripted(self.script, turn)

    def take(self, answer: Answer) -> None:
        self.input += [{k: v for k, v in item.items() if k != "status"}
                       for item in answer.items]
        for call in answer.calls:
            if isinstance(call.input, str):
                self.input.append({"type": "custom_tool_call_output", "call_id": call.id,
                                   "output": "Success. Updated the following files:\n"
                                             "A notes.txt\n"})
            else:
                self.input.append({"type": "function_call_output", "call_id": call.id,
                                   "output": "Exit code: 0\nWall time: 0.1 seconds\nOutput:\n"
                                             + self.script.result(call.name)})
        if not answer.calls:
            self.input.append(message("user", self.script.task()))


def _codex_scripted(script: Script, turn: int) -> Answer:
    """Codex's scripted answer: a line of commentary and a shell call, or a patch."""
    if turn % 2:
        call = Call(f"call_{_hex(script.rng, 24)}", "apply_patch",
                    f"*** Begin Patch\n*** Update File: {script.path()}\n@@\n-old\n+new\n"
                    "*** End Patch\n")
    else:
        call = Call(f"call_{_hex(script.rng, 24)}", "shell",
                    {"command": ["bash", "-lc", f"rg -n {script.word()}"],
                     "workdir": "/work/demo"})
    text = f"Step {turn}: checking the {script.word()}."
    return Answer(text=text, calls=[call], items=[
        {"type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": text, "annotations": []}]},
        _call_item(call)])


def _call_item(call: Call) -> dict[str, Any]:
    """A call as the Responses API gives it back (and Codex sends it again)."""
    if isinstance(call.input, str):
        return {"type": "custom_tool_call", "call_id": call.id, "name": call.name,
                "input": call.input}
    return {"type": "function_call", "call_id": call.id, "name": call.name,
            "arguments": json.dumps(call.input)}


# --- OpenCode -------------------------------------------------------------------------------


def _oc_tool(name: str, description: str, props: dict[str, Any], required: list[str]
             ) -> dict[str, Any]:
    # OpenCode's tools are zod schemas turned into JSON Schema 2020-12.
    return {"type": "function", "function": {"name": name, "description": description,
            "parameters": {"$schema": "https://json-schema.org/draft/2020-12/schema",
                           "type": "object", "properties": props, "required": required,
                           "additionalProperties": False}}}


OPENCODE_TOOLS = [
    _oc_tool("bash", "Executes a given bash command.",
             {"command": {**_S, "description": "The command to execute"},
              "timeout": {"type": "number"},
              "description": {**_S, "description": "Clear, concise description (5-10 words)"}},
             ["command", "description"]),
    _oc_tool("read", "Reads a file from the local filesystem.",
             {"filePath": _S, "offset": {"type": "number"}, "limit": {"type": "number"}},
             ["filePath"]),
    _oc_tool("edit", "Performs exact string replacements in files.",
             {"filePath": _S, "oldString": _S, "newString": _S,
              "replaceAll": {"type": "boolean"}}, ["filePath", "oldString", "newString"]),
    _oc_tool("write", "Writes a file to the local filesystem.",
             {"filePath": _S, "content": _S}, ["filePath", "content"]),
    _oc_tool("glob", "Fast file pattern matching tool.", {"pattern": _S, "path": _S},
             ["pattern"]),
    _oc_tool("grep", "Fast content search tool.", {"pattern": _S, "path": _S, "include": _S},
             ["pattern"]),
    _oc_tool("list", "Lists files and directories in a given path.",
             {"path": _S, "ignore": {"type": "array", "items": _S}}, []),
    _oc_tool("todowrite", "Use this tool to create and manage a structured task list.",
             {"todos": {"type": "array", "items": {"type": "object", "properties": {
                 "content": _S, "status": _S, "priority": _S, "id": _S},
                 "required": ["content", "status", "priority", "id"],
                 "additionalProperties": False}}}, ["todos"]),
]


class OpenCode(AgentSession):
    """OpenCode with an OpenAI-compatible provider (``@ai-sdk/openai-compatible``):
    ``POST /v1/chat/completions``, the model named as the user's provider config names it.

    From OpenCode's sources (packages/opencode: session/prompt, provider/transform; the AI
    SDK's openai-compatible chat model): two system messages (the agent's prompt, then the
    environment and AGENTS.md), tools as functions with 2020-12 schemas, ``stream`` with
    ``stream_options.include_usage``, ``max_tokens`` 32000 (OpenCode's output cap), and the
    sampling it sets for the model family. A user turn's content is a string; an assistant
    turn carries its text and ``tool_calls`` (arguments as JSON text), each answered by a
    ``tool`` message."""

    name = "opencode"
    route = "/v1/chat/completions"

    def __init__(self, script: Script, *, model: str = "qwen3-coder-local",
                 system_chars: int = 4000, resumed: int = 0) -> None:
        self.script = script
        self.model = model
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are opencode, an interactive CLI tool that "
             "helps users with software engineering tasks.\n" + script.filler(system_chars)},
            {"role": "system", "content": "Here is some useful information about the "
             "environment you are running in:\n<env>\n  Working directory: /home/u/proj\n"
             "  Is directory a git repo: yes\n  Platform: darwin\n</env>"},
            {"role": "user", "content": script.task()},
        ]
        for i in range(resumed):
            self.take(Answer(text="" if i else "I'll look at the code first.", calls=[
                Call(f"call_{_hex(script.rng, 24)}", "read", {"filePath": script.path()})]))

    def request(self) -> Request:
        return Request(self.route, {"user-agent": "opencode/1.0 ai-sdk/openai-compatible"}, {
            "model": self.model, "messages": self.messages, "tools": OPENCODE_TOOLS,
            "tool_choice": "auto", "max_tokens": 32000, "temperature": 0.55, "top_p": 1,
            "stream": True, "stream_options": {"include_usage": True}})

    def scripted(self, turn: int) -> Answer:
        tool, given = [("read", {"filePath": self.script.path()}),
                       ("grep", {"pattern": self.script.word()}),
                       ("bash", {"command": "pytest -x -q", "description": "Run the tests"}),
                       ][turn % 3]
        return Answer(text=f"Step {turn}: checking the {self.script.word()}.",
                      calls=[Call(f"call_{_hex(self.script.rng, 24)}", tool, given)])

    def take(self, answer: Answer) -> None:
        turn: dict[str, Any] = {"role": "assistant", "content": answer.text}
        if answer.calls:
            turn["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": json.dumps(c.input)}} for c in answer.calls]
        self.messages.append(turn)
        if not answer.calls:
            self.messages.append({"role": "user", "content": self.script.task()})
        for call in answer.calls:
            self.messages.append({"role": "tool", "tool_call_id": call.id,
                                  "content": self.script.result(call.name)})


# --- Cline ----------------------------------------------------------------------------------

CLINE_TOOLS = ("execute_command", "read_file", "write_to_file", "replace_in_file",
               "search_files", "list_files", "attempt_completion")
_CLINE_TOOL = re.compile(r"<(" + "|".join(CLINE_TOOLS) + r")>")


class Cline(AgentSession):
    """Cline with its "OpenAI Compatible" provider: ``POST /v1/chat/completions``.

    From Cline's sources (src/core/prompts/system.ts, src/core/task, the OpenAI-compatible
    provider): one long system message describing its tools as XML (the model answers with
    ``<read_file><path>...</path></read_file>`` in its text), ``temperature`` 0, streamed
    with ``stream_options.include_usage``; user turns are lists of text parts: the
    ``<task>``, then ``<environment_details>``; a tool's result comes back as
    ``[tool for 'arg'] Result:`` and its output; an answer with no tool use gets Cline's own
    reminder to use one."""

    name = "cline"
    route = "/v1/chat/completions"

    def __init__(self, script: Script, *, model: str = "local-model",
                 system_chars: int = 6000, resumed: int = 0) -> None:
        self.script = script
        self.model = model
        tools = "\n\n".join(f"## {t}\nUsage:\n<{t}>\n<path>path here</path>\n</{t}>"
                            for t in CLINE_TOOLS)
        self.system = ("You are Cline, a highly skilled software engineer.\n\n====\n\nTOOL USE"
                       "\n\nYou have access to a set of tools. Tool use is formatted using "
                       "XML-style tags.\n\n# Tools\n\n" + tools + "\n\n====\n\nRULES\n\n"
                       + script.filler(system_chars))
        self.turns = 0
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": [
            {"type": "text", "text": f"<task>\n{script.task()}\n</task>"},
            self._environment()]}]
        for _ in range(resumed):
            self.take(Answer(text="I need the file's content first.\n<read_file>\n<path>"
                                  f"{script.path()}</path>\n</read_file>"))

    def _environment(self) -> dict[str, Any]:
        self.turns += 1
        return {"type": "text", "text": "<environment_details>\n# VSCode Visible Files\n"
                f"{self.script.path()}\n\n# Current Time\n2026-11-27 10:{self.turns:02d}\n"
                "</environment_details>"}

    def request(self) -> Request:
        return Request(self.route, {"user-agent": "Cline"}, {
            "model": self.model, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": self.system}, *self.messages]})

    def scripted(self, turn: int) -> Answer:
        return Answer(text=f"Step {turn}: I need to read the file.\n<read_file>\n<path>"
                           f"{self.script.path()}</path>\n</read_file>")

    def take(self, answer: Answer) -> None:
        self.messages.append({"role": "assistant", "content": answer.text})
        used = _CLINE_TOOL.search(answer.text)
        if used is None:
            parts = [{"type": "text", "text": "[ERROR] You did not use a tool in your "
                      "previous response! Please retry with a tool use."}]
        else:
            tool = used.group(1)
            parts = [{"type": "text", "text": f"[{tool} for '{self.script.path()}'] Result:"},
                     {"type": "text", "text": self.script.result(tool)}]
        self.messages.append({"role": "user", "content": [*parts, self._environment()]})
