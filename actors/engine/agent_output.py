"""Reads a chat answer's text as it streams: plain text, reasoning, and whole tool calls.

The engine makes one ``OutputParser`` per chat request (from its ``OutputSpec``) and feeds it
the decoded text deltas on the MLX thread. Markup never reaches ``text``: a suffix that may be
the start of a marker is held back until it is known not to be one, as ``StopStringFilter``
does for stop strings. Tool-call markup is parsed by the format's parser: every mlx-lm
``tool_parsers`` module by name, plus troupe's own ``llama3_json`` and ``harmony``.
"""

from __future__ import annotations

import importlib
import json
import logging
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from troupe.actors.messages import OutputSpec, ToolCall

log = logging.getLogger("actors.engine.agent_output")

# The format admission uses for a model whose template names none: Hermes-style JSON in
# <tool_call> tags, which most instruction-tuned models follow when the prompt describes it.
FALLBACK_TOOL_FORMAT = "json_tools"

LLAMA3_JSON = "llama3_json"
HARMONY = "harmony"

PYTHON_TAG = "<|python_tag|>"
# Harmony's (gpt-oss) control tokens. <|call|> and <|return|> are end-of-sequence tokens, so
# the engine usually cuts them before they reach the text.
H_START, H_CHANNEL, H_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
H_END, H_RETURN, H_CALL, H_CONSTRAIN = "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"
_H_RECIPIENT = re.compile(r"to=([^\s<]+)")
_H_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")

_TEXT, _REASONING, _CALL, _HEADER = range(4)


@dataclass
class Parsed:
    """What one ``feed`` (or ``finish``) made of the text: each field is a delta."""

    text: str = ""  # content safe to show now
    reasoning: str = ""  # reasoning delta
    tool_calls: list[ToolCall] = field(default_factory=list)  # calls completed by this feed, whole


@dataclass(frozen=True)
class _Format:
    """A tool-call format: its start marker, its end marker ("" = the call runs to the end of
    the output) and ``parse(body, tools)``, which returns a call dict or a list of them."""

    name: str
    start: str
    end: str
    parse: Callable[[str, list[dict] | None], Any]


class _Markers:
    """A set of markers, each with what to do on meeting it; finds the first and measures
    how much of a text's end may be the start of one."""

    __slots__ = ("actions", "first", "longest")

    def __init__(self, actions: dict[str, Callable[[str], None] | None]) -> None:
        self.actions = {m: a for m, a in actions.items() if m}
        self.first = frozenset(m[0] for m in self.actions)
        self.longest = max(map(len, self.actions), default=0)

    def find(self, buf: str, start: int = 0) -> tuple[int, str] | None:
        """The earliest marker in ``buf`` from ``start`` (the longest where two begin at once)."""
        best: tuple[int, str] | None = None
        for m in self.actions:
            i = buf.find(m, start)
            if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(m) > len(best[1]))):
                best = (i, m)
        return best

    def held(self, buf: str) -> int:
        """The length of the longest suffix of ``buf`` that is a proper prefix of a marker."""
        n = len(buf)
        for i in range(max(0, n - self.longest + 1), n):
            if buf[i] in self.first:
                tail = buf[i:]
                if any(m.startswith(tail) for m in self.actions):
                    return n - i
        return 0


class OutputParser:
    """Splits one answer's streamed text into text, reasoning and whole tool calls.

    ``feed`` each decoded delta, then ``finish`` once at the end of the output. Neither raises:
    a closed call that cannot be read comes back as text, a call the end of the output cut is
    dropped, both with a warning logged. A call that repeats an earlier call of the answer
    (same name, same arguments as JSON) ends the answer: it and all after it are dropped, and
    ``ended`` tells the engine to end the request."""

    def __init__(self, spec: OutputSpec, *, id_prefix: str = "call_") -> None:
        self._id_prefix = id_prefix
        self._tools = spec.tools
        self._tool_names = _tool_names(spec.tools)
        self._fmt = _load_format(spec.tool_format) if spec.tool_format else None
        self._harmony = self._fmt is not None and self._fmt.name == HARMONY
        self._bare_json = self._fmt is not None and self._fmt.name == LLAMA3_JSON
        think = spec.think if spec.think and all(spec.think) else None
        # Nothing to look for: every token of a plain chat takes the cheap path.
        self._passthrough = self._fmt is None and think is None

        self._buf = ""
        self._out = Parsed()
        self._mode = _REASONING if think and spec.in_reasoning else _TEXT
        self._strip = self._mode == _REASONING  # drop whitespace at the start of the next part
        self._started = False  # some answer text (or a call) has been seen
        self._calls = 0
        self._call_raw = ""  # the markup that opened the call (or harmony header) being read
        self._recipient = ""  # harmony: the call's recipient, functions.NAME
        self._scan = 0  # where the search for the call's end marker resumes
        self._seen: set[tuple[str, str]] = set()  # (name, arguments as sorted JSON) of each call
        self._ended = False
        self._cut = False  # finish was told the output was cut short

        text: dict[str, Callable[[str], None] | None] = {}
        reasoning: dict[str, Callable[[str], None] | None] = {}
        if think:
            text[think[0]] = self._open_reasoning
            # A closing tag with no opening one (the template opened it unseen): never show it.
            text[think[1]] = self._close_reasoning
            reasoning[think[1]] = self._close_reasoning
            reasoning[think[0]] = self._drop
        if self._harmony:
            for m in (H_START, H_CHANNEL):
                text[m] = reasoning[m] = self._open_header
            for m in (H_END, H_RETURN, H_CALL):
                text[m] = self._drop
                reasoning[m] = self._close_reasoning
            for m in (H_MESSAGE, H_CONSTRAIN):
                text[m] = reasoning[m] = self._drop
            ends: tuple[str, ...] = (H_CALL, H_END, H_RETURN)
        elif self._fmt is not None:
            text[self._fmt.start] = self._open_call
            ends = (self._fmt.end,) if self._fmt.end else ()
        else:
            ends = ()
        self._text = _Markers(text)
        self._reasoning = _Markers(reasoning)
        self._ends = _Markers(dict.fromkeys(ends))
        # Harmony's <|call|> is an end-of-sequence token, usually cut before the text: there,
        # as in formats with no end marker, the end of the output closes the call.
        self._closes_at_finish = self._harmony or (self._fmt is not None and not self._fmt.end)
        self._steps = {
            _TEXT: self._in_text,
            _REASONING: self._in_reasoning,
            _CALL: self._in_call,
            _HEADER: self._in_header,
        }

    @property
    def in_reasoning(self) -> bool:
        """Whether the text read so far ends inside the model's reasoning."""
        return self._mode == _REASONING

    @property
    def calls_made(self) -> int:
        """How many tool calls have come out so far."""
        return self._calls

    @property
    def ended(self) -> bool:
        """Whether a call repeated an earlier call of this answer: the answer ended there, and
        whatever follows is dropped (an agent never receives the same call twice a turn)."""
        return self._ended

    def feed(self, text: str) -> Parsed:
        """Add a decoded delta; return what of it is known now. A suffix that may begin a
        marker, and a call not yet closed, are held until a later feed or ``finish``."""
        if self._passthrough:
            return Parsed(text=text)
        self._out = out = Parsed()
        if self._ended:
            return out
        self._buf += text
        while not self._ended and self._steps[self._mode](False):
            pass
        return out

    def finish(self, *, cut: bool = False) -> Parsed:
        """The output has ended: return everything still held. A call its end marker never
        closed is dropped. ``cut``: the output was cut short (max_tokens, a stop string), so
        a call of a format without an end marker that cannot be read is a cut call too: it
        is dropped, and the complete calls before it are kept; so is text at the end that
        may begin a marker."""
        if self._passthrough:
            return Parsed()
        self._out = out = Parsed()
        self._cut = cut
        while not self._ended and self._steps[self._mode](True):
            pass
        self._buf = ""
        return out

    # --- the states: each step returns whether to step again ---------------------------------

    def _stripped(self) -> str | None:
        """The buffer, with the whitespace due to be dropped (after a tag or a call) dropped;
        None while nothing but that whitespace has come."""
        if self._strip:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return None
            self._strip = False
        return self._buf

    def _in_text(self, final: bool) -> bool:
        buf = self._stripped()
        if buf is None:
            return False
        if self._bare_json and not self._started:
            # Llama 3.x answers a call with bare JSON: an answer that starts with "{" is one.
            body = buf.lstrip()
            if body.startswith("{"):
                self._open_call(buf[: len(buf) - len(body)])
                self._buf = body
                return True
            if not final and (not body or PYTHON_TAG.startswith(body)):
                return False
            if body.startswith(PYTHON_TAG):
                buf = self._buf = body
            self._started = True
        hit = self._text.find(buf)
        if hit is not None:
            i, marker = hit
            self._emit_text(buf[:i])
            self._buf = buf[i + len(marker) :]
            action = self._text.actions[marker]
            if action is not None:
                action(marker)
            return True
        # At a cut, what may begin a marker is the start of markup the cut ended: never text.
        keep = self._text.held(buf) if not final or self._cut else 0
        self._emit_text(buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep :]
        return False

    def _in_reasoning(self, final: bool) -> bool:
        buf = self._stripped()
        if buf is None:
            return False
        hit = self._reasoning.find(buf)
        if hit is not None:
            i, marker = hit
            self._out.reasoning += buf[:i].rstrip()
            self._buf = buf[i + len(marker) :]
            action = self._reasoning.actions[marker]
            if action is not None:
                action(marker)
            return True
        # Trailing whitespace waits too: the reasoning's last newline before the tag is dropped.
        cut = len(buf) - (0 if final else self._reasoning.held(buf))
        cut = len(buf[:cut].rstrip())
        self._out.reasoning += buf[:cut]
        self._buf = "" if final else buf[cut:]
        return False

    def _in_call(self, final: bool) -> bool:
        if self._ends.actions:
            hit = self._ends.find(self._buf, self._scan)
            if hit is not None:
                i, marker = hit
                body, self._buf = self._buf[:i], self._buf[i + len(marker) :]
                self._close_call(body, marker)
                return True
            if not final:
                # The body can be long: search only what may hold the end marker next time.
                self._scan = max(0, len(self._buf) - self._ends.longest + 1)
                return False
        if not final:
            return False
        body, self._buf = self._buf, ""
        if self._closes_at_finish:
            self._close_call(body, "")
        else:
            self._mode = _TEXT
            log.warning("tool call not closed at the end of the output (cut by max_tokens?), "
                        "dropped")
        return True

    def _in_header(self, final: bool) -> bool:
        i = self._buf.find(H_MESSAGE)
        if i >= 0:
            header = self._call_raw + self._buf[:i]
            self._buf = self._buf[i + len(H_MESSAGE) :]
            self._open_message(header)
            return True
        if not final:
            return False
        header, self._buf = self._call_raw + self._buf, ""
        self._mode = _TEXT
        if _H_RECIPIENT.search(header):
            log.warning("tool call header not closed at the end of the output (cut by "
                        "max_tokens?), dropped")
        return True

    # --- transitions -----------------------------------------------------------------------

    def _drop(self, marker: str) -> None:
        pass

    def _open_reasoning(self, marker: str) -> None:
        self._mode = _REASONING
        self._strip = True

    def _close_reasoning(self, marker: str) -> None:
        self._mode = _TEXT
        self._strip = True  # models write "</think>\n\n" before the answer

    def _open_call(self, marker: str) -> None:
        self._mode = _CALL
        self._call_raw = marker
        self._scan = 0
        self._started = True

    def _open_header(self, marker: str) -> None:
        self._mode = _HEADER
        self._call_raw = marker
        self._strip = False

    def _open_message(self, header: str) -> None:
        """Harmony: a message's header is read; its channel and recipient say what follows."""
        recipient = _H_RECIPIENT.search(header)
        if recipient is not None:
            self._recipient = recipient.group(1)
            self._open_call(header + H_MESSAGE)
            return
        channel = _H_CHANNEL.search(header)
        if channel is not None and channel.group(1) == "analysis":
            self._open_reasoning(header)
        else:  # final, or commentary with no recipient (a preamble the user may see)
            self._mode = _TEXT

    def _close_call(self, body: str, end: str) -> None:
        """Parse a closed call's body into calls, or give its markup back as text. Where the
        end of a cut output closed it, a body that cannot be read is a cut call: dropped, the
        complete calls before it kept."""
        raw = self._call_raw + body + end
        self._mode = _TEXT
        try:
            try:
                parsed = self._parse(body)
            except Exception:
                if not self._cut or end:
                    raise
                log.warning("tool call cut by the end of the output, dropped")
                parsed = self._before_cut(body)
            unknown = sorted({name for name, _, _ in parsed} - self._tool_names)
            if unknown:
                log.warning(
                    "tool call to %s, not among the request's tools, returned as text",
                    ", ".join(unknown),
                )
                self._emit_text(raw)
                return
            parsed = self._unrepeated(parsed)
            calls = [
                ToolCall(
                    index=self._calls + n,
                    id=call_id or self._id_prefix + secrets.token_hex(12),
                    name=name,
                    arguments=json.dumps(arguments, ensure_ascii=False),
                )
                for n, (name, arguments, call_id) in enumerate(parsed)
            ]
        except Exception as e:  # a parser of any format may fail in its own way: never raise
            # Some parsers put the whole body in the message: keep the log line short.
            why = f"{type(e).__name__}: {str(e)[:200]}"
            log.warning("tool call not parsed (%s), returned as text", why)
            self._emit_text(raw)
            return
        self._out.tool_calls.extend(calls)
        self._calls += len(calls)
        self._strip = True  # the newlines between and after calls are layout, not text

    def _unrepeated(self, parsed: list[tuple[str, dict, str | None]]
                    ) -> list[tuple[str, dict, str | None]]:
        """The calls up to the first that repeats an earlier one of the answer; at one, the
        answer ends (small models loop on the same call until max_tokens)."""
        for n, (name, arguments, _) in enumerate(parsed):
            key = (name, json.dumps(arguments, sort_keys=True))
            if key in self._seen:
                log.info("tool call to %s repeats an earlier call of the answer: answer ended",
                         name)
                self._ended = True
                self._buf = ""
                return parsed[:n]
            self._seen.add(key)
        return parsed

    def _before_cut(self, body: str) -> list[tuple[str, dict, str | None]]:
        """The complete calls of a format without an end marker whose last call the end of
        the output cut: the longest head of ``body`` ending before a call's start marker
        (llama3_json: before a ";") that parses; none when no head does."""
        assert self._fmt is not None
        marks = [m for m in (self._fmt.start, ";" if self._bare_json else "") if m]
        heads = sorted({i for m in marks for i in _positions(body, m)}, reverse=True)
        for i in heads:
            try:
                return self._parse(body[:i])
            except Exception:
                continue
        return []

    def _parse(self, body: str) -> list[tuple[str, dict, str | None]]:
        """(name, arguments, the model's id or None) of each call in ``body``; raises when the
        body is not well-formed calls."""
        assert self._fmt is not None
        if self._harmony:
            name = self._recipient.removeprefix("functions.")
            arguments = json.loads(body) if body.strip() else {}
            return _checked([{"name": name, "arguments": arguments}])
        return _checked(self._fmt.parse(body, self._tools))

    def _emit_text(self, text: str) -> None:
        if text:
            self._out.text += text
            self._started = True


def _checked(result: Any) -> list[tuple[str, dict, str | None]]:
    """A parser's result as (name, arguments, id) triples; raises ValueError when malformed."""
    items = result if isinstance(result, list) else [result]
    if not items:
        raise ValueError("no call in the markup")
    calls = []
    for item in items:
        if not isinstance(item, dict):
            raise ValueError("a call is not an object")
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError("a call has no name")
        # Llama 3.x writes "parameters"; some models give the arguments as JSON text.
        arguments = item.get("arguments", item.get("parameters"))
        if isinstance(arguments, str):
            arguments = json.loads(arguments) if arguments.strip() else {}
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            raise ValueError(f"the arguments of {name} are not an object")
        call_id = item.get("id")
        calls.append((name, arguments, call_id if isinstance(call_id, str) and call_id else None))
    return calls


def _positions(text: str, sub: str) -> list[int]:
    """Where ``sub`` occurs in ``text``."""
    found, i = [], text.find(sub)
    while i >= 0:
        found.append(i)
        i = text.find(sub, i + 1)
    return found


def _tool_names(tools: list[dict] | None) -> frozenset[str]:
    names = set()
    for tool in tools or ():
        if isinstance(tool, dict):
            function = tool.get("function", tool)
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                names.add(function["name"])
    return frozenset(names)


def _parse_llama3_json(text: str, tools: list[dict] | None = None) -> list[dict]:
    """Llama 3.x calls: JSON objects, each maybe after <|python_tag|>, separated by ";" or
    whitespace."""
    decoder = json.JSONDecoder()
    calls = []
    pos = 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
            pos += 1
        if text.startswith(PYTHON_TAG, pos):
            pos += len(PYTHON_TAG)
            continue
        if pos == len(text):
            break
        call, pos = decoder.raw_decode(text, pos)
        calls.append(call)
    if not calls:
        raise ValueError("no call in the markup")
    return calls


def _no_parse(text: str, tools: list[dict] | None = None) -> Any:
    raise NotImplementedError  # harmony's calls are read by OutputParser._parse


@lru_cache(maxsize=64)
def _load_format(name: str) -> _Format | None:
    """The named format, or None (logged) when there is no such format."""
    if name == LLAMA3_JSON:
        return _Format(LLAMA3_JSON, PYTHON_TAG, "", _parse_llama3_json)
    if name == HARMONY:
        return _Format(HARMONY, "", "", _no_parse)
    if not name.isidentifier():
        log.error("no tool-call format %r: tool calls will not be parsed", name)
        return None
    try:
        module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
        return _Format(name, module.tool_call_start, module.tool_call_end, module.parse_tool_call)
    except (ImportError, AttributeError):
        log.error("no tool-call format %r: tool calls will not be parsed", name)
        return None


def tool_format_of(tokenizer: Any) -> str | None:
    """The tool-call format of an mlx-lm ``TokenizerWrapper``: mlx-lm's inferred parser name
    when it has one, else troupe's own "llama3_json" or "harmony" detected from the chat
    template, else None."""
    init_kwargs = getattr(tokenizer, "init_kwargs", None)
    if isinstance(init_kwargs, dict) and init_kwargs.get("tool_parser_type"):
        return init_kwargs["tool_parser_type"]
    module = getattr(getattr(tokenizer, "tool_parser", None), "__module__", None) or ""
    if module.startswith("mlx_lm.tool_parsers."):
        return module.rsplit(".", 1)[1]
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates
        template = "\n".join(t for t in template.values() if isinstance(t, str))
    if not isinstance(template, str):
        return None
    if H_CHANNEL in template and H_MESSAGE in template:
        return HARMONY
    # Llama 3.1/3.3 name <|python_tag|>; 3.2's template only describes the JSON it wants.
    if PYTHON_TAG in template or '"parameters": dictionary of argument name' in template:
        return LLAMA3_JSON
    return None


def think_tags_of(tokenizer: Any) -> tuple[str, str] | None:
    """(start, end) reasoning tags from the wrapper (think_start/think_end), None when none."""
    start = getattr(tokenizer, "think_start", None)
    end = getattr(tokenizer, "think_end", None)
    if isinstance(start, str) and isinstance(end, str) and start and end:
        return start, end
    return None


def prompt_opens_reasoning(prompt_text_tail: str, think: tuple[str, str] | None) -> bool:
    """Whether the rendered prompt's end leaves a reasoning tag open (e.g. Qwen3's template ends
    with '<think>\\n'): the model's output then starts inside its reasoning."""
    if not think:
        return False
    start = prompt_text_tail.rfind(think[0])
    return start >= 0 and prompt_text_tail.rfind(think[1]) < start
