"""Judging what the server answered: every request's one outcome (``Ledger``), the raw HTTP
answer read off a socket (``parse_answer``), refusals (``judge_refusal``: the status's error
shape, Retry-After on a 429) and whole answers (``judge_answer``: finish reasons, tool calls
and JSON output held to their constraint).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from troupe.tools.soak.corpus import (
    Shape,
    error_shape_problem,
)
from troupe.tools.soak.traffic import CITY_SCHEMA, Spec

# Outcomes: every request gets exactly one. The first are answers a server may give; the
# last three fail the run.
ACCEPTED = ("complete", "refused", "rate_limited", "unavailable", "client_cut", "idle_closed",
            "killed", "shutdown")
FAILED = ("server_error", "bad_answer", "lost")


@dataclass(slots=True)
class Record:
    """One request: when it started (seconds into the run), on which server instance, and
    the one outcome it got."""

    id: int
    phase: str
    kind: str
    fault: str | None
    instance: int
    started: float
    ended: float | None = None
    outcome: str | None = None
    status: int | None = None
    ttft: float | None = None
    tokens: int = 0
    detail: str = ""

    @property
    def latency(self) -> float | None:
        return None if self.ended is None else self.ended - self.started


class Ledger:
    """Every request the soak makes, and the outcome each got: a second outcome for the same
    request is a violation of its own."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.records: list[Record] = []
        self.violations: list[str] = []

    def open(self, phase: str, kind: str, fault: str | None, instance: int) -> Record:
        record = Record(len(self.records), phase, kind, fault, instance, self.clock())
        self.records.append(record)
        return record

    def close(self, record: Record, outcome: str, *, status: int | None = None,
              detail: str = "", tokens: int = 0, ttft: float | None = None) -> None:
        if outcome not in ACCEPTED + FAILED:
            raise ValueError(f"unknown outcome {outcome!r}")
        if record.outcome is not None:
            self.violations.append(f"request {record.id} ({record.kind}) got a second outcome "
                                   f"{outcome!r} after {record.outcome!r}")
            return
        record.ended, record.outcome, record.status = self.clock(), outcome, status
        record.detail, record.tokens, record.ttft = detail[:300], tokens, ttft

    def of_phase(self, phase: str) -> list[Record]:
        return [r for r in self.records if r.phase == phase]


@dataclass(frozen=True, slots=True)
class RawAnswer:
    status: int
    headers: dict[str, str]
    body: bytes


def parse_answer(raw: bytes) -> RawAnswer | None:
    """The HTTP/1.1 response in ``raw`` (read until the server closed), None for no bytes.
    Raises ValueError for bytes that are not a whole response."""
    if not raw:
        return None
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        raise ValueError("a response head that never ended")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        out, rest = b"", body
        while True:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2:]
        body = out
    elif "content-length" in headers and len(body) < int(headers["content-length"]):
        raise ValueError(f"{len(body)} of {headers['content-length']} body bytes")
    return RawAnswer(status, headers, body)


def json_or_none(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None


# --- judging answers -------------------------------------------------------------------------


def judge_refusal(status: int, retry_after: str | None, body: bytes, shape: Shape
                  ) -> tuple[str, str]:
    """The outcome of a non-200 answer, and why: a 4xx, 429 or 503 must come with its error
    body in the route's shape (a 429 with Retry-After in seconds); any other 5xx fails."""
    parsed = json_or_none(body)
    if status >= 500 and status != 503:
        return "server_error", f"HTTP {status}: {body[:200]!r}"
    problem = error_shape_problem(shape, status, parsed)
    if problem:
        return "bad_answer", f"HTTP {status}: {problem}: {body[:200]!r}"
    if status == 429:
        if retry_after is None or not retry_after.isdigit():
            return "bad_answer", f"429 with Retry-After {retry_after!r}"
        return "rate_limited", f"Retry-After {retry_after}"
    message = parsed["error"]["message"]
    return ("unavailable" if status == 503 else "refused"), f"HTTP {status}: {message[:200]}"


def judge_answer(spec: Spec, body: Any) -> tuple[str | None, int]:
    """What is wrong with a whole 200 answer (None: nothing), and its completion tokens.
    Constrained answers that ended by themselves must hold to their constraint."""
    if not isinstance(body, dict):
        return "not a JSON object", 0
    try:
        if spec.shape == "openai":
            choice = body["choices"][0]
            finish, message = choice["finish_reason"], choice["message"]
            tokens = body["usage"]["completion_tokens"]
            if finish not in ("stop", "length", "tool_calls"):
                return f"finish_reason {finish!r}", tokens
            if spec.kind == "tools" and spec.body.get("tool_choice") == "required":
                if finish == "tool_calls":
                    for call in message["tool_calls"]:
                        json.loads(call["function"]["arguments"])
                elif finish != "length":
                    return f"tool_choice required but finish_reason {finish!r}", tokens
            if spec.kind == "json" and finish == "stop":
                return _schema_problem(message["content"]), tokens
            return None, tokens
        stop, blocks = body["stop_reason"], body["content"]
        tokens = body["usage"]["output_tokens"]
        if stop not in ("end_turn", "max_tokens", "stop_sequence", "tool_use"):
            return f"stop_reason {stop!r}", tokens
        if spec.kind == "tools" and spec.body.get("tool_choice") == {"type": "any"}:
            if stop == "tool_use":
                if not all(isinstance(b["input"], dict) for b in blocks if b["type"] == "tool_use"):
                    return "a tool_use block whose input is not an object", tokens
            elif stop != "max_tokens":
                return f"tool_choice any but stop_reason {stop!r}", tokens
        if spec.kind == "json" and stop == "end_turn":
            text = "".join(b["text"] for b in blocks if b["type"] == "text")
            return _schema_problem(text), tokens
        return None, tokens
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        return f"malformed answer ({type(exc).__name__}: {exc})", 0


def _schema_problem(text: str) -> str | None:
    value = json_or_none(text.encode())
    if not isinstance(value, dict) or set(value) != set(CITY_SCHEMA["required"]):
        return f"JSON output not matching its schema: {text[:120]!r}"
    return None
