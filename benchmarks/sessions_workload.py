"""The scripted agent conversations of the session replay benchmark (benchmarks/sessions.py).

Every session shares one system prompt (agent instructions) and one set of OpenAI ``tools``,
as the sessions of one agent product do, so a server's cache may share that prefix between
them. After it, each session's text is its own from its first token (a session tag opens its
first user message): turns that add a user message, or a tool call of the assistant's
followed by the ``tool`` message that answers it, of ``message_tokens`` tokens each, sized
so that the conversation reaches about ``context_tokens`` tokens at its last turn. Everything
is made from ``seed`` with a ``random.Random``: no network, the same script on every run and
for every server. Sizes are counted with the model's own tokenizer.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]

WORDS = (
    "parser scheduler cache block token request batch stream queue worker index writer "
    "config handler router session buffer socket payload schema decoder encoder retry "
    "timeout budget metric counter snapshot manifest layer tensor kernel shard replica "
    "lease lock mutex channel future promise callback registry plugin adapter fixture "
    "migration rollback commit branch review lint format coverage profile trace span"
).split()
VERBS = (
    "refactor rename split merge cache validate flush retry drop rebuild measure document "
    "parse serialize index evict prefetch batch stream profile trace patch revert"
).split()
FILES = ("api/server.py actors/scheduler.py actors/cache_index.py runtime/mailbox.py "
         "tests/test_scheduler.py docs/architecture.md actors/engine/core.py api/openai.py "
         "benchmarks/harness.py actors/ssd_writer.py runtime/actor.py api/decode.py").split()

SYSTEM_HEAD = (
    "You are Ensemble, an autonomous software engineering agent working inside a git "
    "repository on the user's machine. You read code, run commands and tests through the "
    "tools below, and change files only when the task asks for it. Work in small, "
    "verifiable steps: state what you will do, call one tool, read its result, then decide "
    "the next step. Never invent file contents or command output: call a tool instead. "
    "When the task is done, answer with a short summary of what changed and why.\n\n"
    "# Repository conventions\n"
)
RULES = (
    "Keep every public function typed and documented in one line. ",
    "Tests state the behaviour they pin in their names. ",
    "Prefer the standard library; add a dependency only with a reason. ",
    "A commit message says why, not what. ",
    "Log at INFO only what an operator needs; DEBUG for the rest. ",
    "Never swallow an exception without logging it once. ",
    "Configuration lives in one struct with its defaults. ",
    "Benchmarks print the command that made each figure. ",
)


def _tool(name: str, description: str, props: dict[str, tuple[str, str]],
          required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "required": required, "properties": {
            key: {"type": kind, "description": text} for key, (kind, text) in props.items()}},
    }}


TOOLS: list[dict[str, Any]] = [
    _tool("read_file", "Read a text file of the repository, whole or a range of lines.",
          {"path": ("string", "path relative to the repository root"),
           "start_line": ("integer", "first line to read, 1-based"),
           "end_line": ("integer", "last line to read, inclusive")}, ["path"]),
    _tool("write_file", "Replace a file's whole content, creating it if needed.",
          {"path": ("string", "path relative to the repository root"),
           "content": ("string", "the new content")}, ["path", "content"]),
    _tool("edit_file", "Replace one exact occurrence of a string in a file.",
          {"path": ("string", "path relative to the repository root"),
           "old": ("string", "the exact text to replace; must occur once"),
           "new": ("string", "the replacement text")}, ["path", "old", "new"]),
    _tool("grep", "Search the repository for a regular expression; prints path:line: text.",
          {"pattern": ("string", "a Python regular expression"),
           "path": ("string", "a folder or file to search, default the whole repository")},
          ["pattern"]),
    _tool("list_dir", "List a folder's entries with their sizes.",
          {"path": ("string", "a folder relative to the repository root")}, ["path"]),
    _tool("run_tests", "Run pytest on some tests and return its report.",
          {"target": ("string", "a test file, folder or node id"),
           "keyword": ("string", "a -k expression to select tests")}, ["target"]),
    _tool("run_shell", "Run a shell command in the repository and return its output.",
          {"command": ("string", "the command line"),
           "timeout_s": ("integer", "seconds before the command is stopped")}, ["command"]),
    _tool("git_diff", "Show the working tree's changes against HEAD.",
          {"path": ("string", "limit the diff to this path")}, []),
]


@dataclass
class Turn:
    """What one turn adds to the conversation before it asks for an answer."""

    kind: str  # "user" or "tool"
    messages: list[Message]
    tokens: int  # the size its text was cut to


@dataclass
class Session:
    index: int
    tag: str
    turns: list[Turn] = field(default_factory=list)


@dataclass
class Workload:
    system: Message
    tools: list[dict[str, Any]]
    sessions: list[Session]
    system_tokens: int  # the system prompt and the tools, as troupe renders them


def cut(tokenizer: Any, text: str, n_tokens: int) -> str:
    """``text`` cut to its first ``n_tokens`` tokens (it must be at least that long)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.decode(ids[:n_tokens])


def _ident(rng: random.Random) -> str:
    return f"{rng.choice(WORDS)}_{rng.choice(WORDS)}{rng.randint(0, 99)}"


def _sentence(rng: random.Random) -> str:
    return (f"{rng.choice(VERBS).capitalize()} the {rng.choice(WORDS)} {rng.choice(WORDS)} in "
            f"{rng.choice(FILES)} so that `{_ident(rng)}` keeps its {rng.choice(WORDS)} "
            f"under {rng.randint(2, 900)} ms. ")


def _user_text(rng: random.Random, n_chars: int) -> str:
    out = []
    while sum(map(len, out)) < n_chars:
        out.append(_sentence(rng))
    return "".join(out)


def _code(rng: random.Random, n_chars: int) -> str:
    lines = []
    while sum(map(len, lines)) < n_chars:
        name, arg = _ident(rng), rng.choice(WORDS)
        lines += [f"def {name}({arg}: int, {rng.choice(WORDS)}: str = '') -> bool:",
                  f'    """{_sentence(rng).strip()}"""',
                  f"    if {arg} > {rng.randint(0, 4096)}:",
                  f"        return self.{_ident(rng)}({arg} - {rng.randint(1, 64)})",
                  f"    return {rng.choice(['True', 'False'])}", ""]
    return "\n".join(lines)


def _grep(rng: random.Random, n_chars: int) -> str:
    lines = []
    while sum(map(len, lines)) < n_chars:
        lines.append(f"{rng.choice(FILES)}:{rng.randint(1, 900)}:     self.{_ident(rng)} = "
                     f"{_ident(rng)}({rng.choice(WORDS)}={rng.randint(0, 512)})")
    return "\n".join(lines)


def _pytest(rng: random.Random, n_chars: int) -> str:
    lines = []
    while sum(map(len, lines)) < n_chars:
        status = rng.choice(["PASSED"] * 6 + ["FAILED", "SKIPPED"])
        lines.append(f"tests/test_{rng.choice(WORDS)}.py::test_{_ident(rng)} {status} "
                     f"[{rng.randint(0, 100):3d}%]")
    return "\n".join(lines) + f"\n{rng.randint(40, 300)} passed in {rng.uniform(1, 90):.2f}s"


TOOL_OUTPUT = {"read_file": _code, "grep": _grep, "run_tests": _pytest, "run_shell": _pytest,
               "list_dir": _grep, "git_diff": _code}


def _call_arguments(rng: random.Random, name: str) -> dict[str, Any]:
    return {"read_file": {"path": rng.choice(FILES), "start_line": rng.randint(1, 300)},
            "grep": {"pattern": rf"\b{rng.choice(WORDS)}_\w+", "path": rng.choice(FILES)},
            "run_tests": {"target": f"tests/test_{rng.choice(WORDS)}.py"},
            "run_shell": {"command": f"make {rng.choice(['lint', 'test', 'bench'])}"},
            "list_dir": {"path": rng.choice(FILES).rsplit("/", 1)[0]},
            "git_diff": {"path": rng.choice(FILES)}}[name]


def system_prompt(tokenizer: Any, seed: int, n_tokens: int, tools: list[dict[str, Any]]
                  ) -> tuple[Message, int]:
    """The shared system message, sized so that it and the tools (as troupe writes them into
    a template without a tool format) make about ``n_tokens``; and their rendered size."""
    from troupe.actors.tool_prompt import tools_instructions

    tools_size = len(tokenizer.encode(tools_instructions(tools), add_special_tokens=False))
    rng = random.Random(f"{seed}-system")
    body = SYSTEM_HEAD
    while len(tokenizer.encode(body, add_special_tokens=False)) < n_tokens:
        body += "".join(rng.sample(RULES, len(RULES))) + "\n" + _user_text(rng, 400) + "\n"
    text = cut(tokenizer, body, max(n_tokens - tools_size, 64))
    return {"role": "system", "content": text}, tools_size + len(
        tokenizer.encode(text, add_special_tokens=False))


def message_sizes(rng: random.Random, turns: int, lo: int, hi: int, total: int) -> list[int]:
    """``turns`` sizes drawn in [lo, hi], scaled together to add up to about ``total``
    (each kept within [lo, hi])."""
    sizes = [rng.uniform(lo, hi) for _ in range(turns)]
    for _ in range(20):
        s = sum(sizes)
        if abs(s - total) < 1:
            break
        sizes = [min(hi, max(lo, x * total / s)) for x in sizes]
    return [round(x) for x in sizes]


def make_session(tokenizer: Any, seed: int, index: int, turns: int, sizes: tuple[int, int],
                 budget: int) -> Session:
    """One session's turns: the first a user's task, then tool results (about 60%) and user
    messages, ``budget`` tokens of message text in all."""
    rng = random.Random(f"{seed}-session-{index}")
    tag = f"{rng.getrandbits(48):012x}"
    session = Session(index, tag)
    for t, n in enumerate(message_sizes(rng, turns, *sizes, budget)):
        if t == 0 or rng.random() < 0.4:
            head = f"Session {tag}. " if t == 0 else ""
            text = cut(tokenizer, head + _user_text(rng, n * 8), n)
            session.turns.append(Turn("user", [{"role": "user", "content": text}], n))
            continue
        name = rng.choice(sorted(TOOL_OUTPUT))
        call_id = f"call_{tag}_{t}"
        output = cut(tokenizer, TOOL_OUTPUT[name](rng, n * 8), n)
        session.turns.append(Turn("tool", [
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": call_id, "type": "function",
                "function": {"name": name,
                             "arguments": json.dumps(_call_arguments(rng, name))}}]},
            {"role": "tool", "tool_call_id": call_id, "content": output},
        ], n))
    return session


def make_workload(tokenizer: Any, *, seed: int, sessions: int, turns: int, system_tokens: int,
                  context_tokens: int, message_tokens: tuple[int, int],
                  max_tokens: int, tools: int = len(TOOLS)) -> Workload:
    """Every session's script, with the first ``tools`` tools. The message budget leaves room
    for the answers (``max_tokens`` each, kept in the history) and the template."""
    tool_list = TOOLS[:tools]
    system, rendered = system_prompt(tokenizer, seed, system_tokens, tool_list)
    budget = context_tokens - rendered - (turns - 1) * (max_tokens + 12) - turns * 30
    lo, hi = message_tokens
    budget = max(budget, lo * turns)
    return Workload(system, tool_list, [make_session(tokenizer, seed, i, turns, message_tokens,
                                                 budget) for i in range(sessions)], rendered)
