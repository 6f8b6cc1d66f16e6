"""What Codex CLI sends the Responses API, as the tests replay it.

Read from codex-rs (openai/codex): the apply_patch freeform tool and its Lark grammar
(codex-rs/core/src/tools/handlers/tool_apply_patch.lark, codex-rs/tools/src/apply_patch_tool.rs),
the request body (codex-rs/codex-api/src/common.rs ``ResponsesApiRequest``), and the items
sent back (codex-rs/protocol/src/models.rs ``ResponseItem``).
"""

from __future__ import annotations

from typing import Any

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
