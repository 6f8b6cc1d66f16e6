"""The soak's bad-input corpus: requests no well-behaved client sends, each with its answer.

Every case is the raw bytes of one HTTP/1.1 request, sent on a connection of its own, so the
server sees exactly those bytes (non-UTF-8, a broken request line, a header too long) and
nothing a client library would tidy up. What must come back is a status and the route's
error shape: Anthropic's on ``/v1/messages`` and below, OpenAI's everywhere else
(``api/errors.py``), or, for the few bad-looking requests a server must take (unknown
fields, a ``top_k`` past the vocabulary), a complete answer. ``troupe soak`` replays the
corpus throughout its run (``tools/soak/``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

Shape = Literal["openai", "anthropic"]

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
# A request the server takes answers with a few tokens: the corpus is about the refusals.
ANSWER_TOKENS = 2
# Deeper than the server's limit (64 levels), at Python's default recursion limit (1,000).
DEEP_LEVELS = 1000


@dataclass(frozen=True, slots=True)
class Case:
    """One bad request and the answer it must get: ``status`` in the ``shape`` of its route
    (an error body for 4xx, a complete answer for 200)."""

    name: str
    raw: bytes
    status: int
    shape: Shape


def request_bytes(
    method: str,
    path: str,
    body: bytes | None = None,
    *,
    headers: tuple[bytes, ...] = (),
    content_length: int | None = None,
) -> bytes:
    """An HTTP/1.1 request that closes its connection after the answer. ``content_length``
    announces a length other than the body's (a body bigger than what is sent)."""
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1", b"Connection: close",
             *headers]
    if body is not None:
        length = len(body) if content_length is None else content_length
        lines += [b"Content-Type: application/json", b"Content-Length: %d" % length]
    return b"\r\n".join(lines) + b"\r\n\r\n" + (body or b"")


def chunked_bytes(path: str, body: bytes, chunk: int = 64 * 1024) -> bytes:
    """A POST whose body is sent chunked (no length announced: the server must count)."""
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    pieces = [b"%x\r\n%s\r\n" % (len(body[i:i + chunk]), body[i:i + chunk])
              for i in range(0, len(body), chunk)]
    return head + b"".join(pieces) + b"0\r\n\r\n"


def nested(levels: int) -> str:
    """JSON text nested ``levels`` deep, objects and arrays alternating (``json.dumps``
    itself cannot write this deep)."""
    opening = "".join("[" if level % 2 else '{"a":' for level in reversed(range(levels)))
    return opening + "1" + "".join("]" if level % 2 else "}" for level in range(levels))


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


def build_corpus(model: str, max_body_bytes: int) -> list[Case]:
    """The corpus for a server that serves ``model`` with ``--max-body-bytes``
    ``max_body_bytes``."""
    user = [{"role": "user", "content": "Say hi."}]

    def chat(**fields: Any) -> dict[str, Any]:
        return {"model": model, "messages": user, "max_tokens": ANSWER_TOKENS, **fields}

    def post(path: str, value: Any) -> bytes:
        return request_bytes("POST", path, _json(value))

    def deep(path: str, body: dict[str, Any]) -> bytes:
        text = json.dumps({**body, "x_unknown": "@deep@"})
        return request_bytes("POST", path, text.replace('"@deep@"', nested(DEEP_LEVELS)).encode())

    whole = _json(chat())
    oversize = b'{"model": "' + b"x" * (max_body_bytes + 64 * 1024) + b'"}'
    ten_mb = 10 * 1024 * 1024
    cases = [
        # OpenAI's chat route.
        Case("malformed-json", request_bytes("POST", CHAT, b'{"model": "m", messages: []}'),
             400, "openai"),
        Case("truncated-json", request_bytes("POST", CHAT, whole[: len(whole) // 2]), 400,
             "openai"),
        Case("empty-body", request_bytes("POST", CHAT, b""), 400, "openai"),
        Case("body-not-an-object", request_bytes("POST", CHAT, b"[1, 2, 3]"), 400, "openai"),
        Case("messages-wrong-type", post(CHAT, chat(messages="hello")), 400, "openai"),
        Case("max-tokens-wrong-type", post(CHAT, chat(max_tokens="8")), 400, "openai"),
        Case("stream-wrong-type", post(CHAT, chat(stream="yes")), 400, "openai"),
        Case("non-utf8-body", request_bytes(
            "POST", CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}'),
             400, "openai"),
        # Announced bigger than the limit: refused from the head, before the body is read.
        Case("body-10MB-announced", request_bytes("POST", CHAT, b"{", content_length=ten_mb),
             413, "openai"),
        Case("body-over-limit-chunked", chunked_bytes(CHAT, oversize), 413, "openai"),
        Case("nested-1000-levels", deep(CHAT, chat()), 400, "openai"),
        Case("unknown-fields", post(CHAT, chat(x_unknown={"a": [1, {"b": None}]},
                                               logit_bias_v2=7)), 200, "openai"),
        Case("max-tokens-negative", post(CHAT, chat(max_tokens=-1)), 400, "openai"),
        Case("temperature-negative", post(CHAT, chat(temperature=-0.5)), 400, "openai"),
        # Served with the budget cut to the room left (the soak's server caps answers too).
        Case("max-tokens-huge", post(CHAT, chat(max_tokens=10**30)), 200, "openai"),
        Case("temperature-huge", request_bytes("POST", CHAT, _json(chat())[:-1]
                                               + b', "temperature": 1e400}'), 400, "openai"),
        # A top_k past the vocabulary keeps every token, as none does; any integer seeds.
        Case("top-k-huge", post(CHAT, chat(temperature=1.0, top_k=2**31)), 200, "openai"),
        Case("seed-negative", post(CHAT, chat(temperature=1.0, seed=-1)), 200, "openai"),
        Case("seed-huge", post(CHAT, chat(temperature=1.0, seed=10**30)), 200, "openai"),
        Case("messages-empty", post(CHAT, chat(messages=[])), 400, "openai"),
        Case("role-unknown", post(CHAT, chat(messages=[{"role": "wizard", "content": "hi"}])),
             400, "openai"),
        Case("n-2", post(CHAT, chat(n=2)), 400, "openai"),
        # The soak serves one model: any name is only a name, served by it, never a path read.
        Case("model-relative-path", post(CHAT, chat(model=f"../models/{model}")), 200,
             "openai"),
        Case("model-absolute-path", post(CHAT, chat(model="/etc/passwd")), 200, "openai"),
        Case("image-part", post(CHAT, chat(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])), 400, "openai"),
        # Anthropic's route: the same faults, its own error shape.
        Case("anthropic-malformed-json", request_bytes("POST", MESSAGES, b'{"model": '), 400,
             "anthropic"),
        Case("anthropic-non-utf8-body", request_bytes(
            "POST", MESSAGES, b'{"model": "m", "max_tokens": 2, "messages": "\xc3\x28"}'), 400,
             "anthropic"),
        Case("anthropic-max-tokens-missing",
             post(MESSAGES, {"model": model, "messages": user}), 400, "anthropic"),
        Case("anthropic-max-tokens-negative", post(MESSAGES, chat(max_tokens=-3)), 400,
             "anthropic"),
        Case("anthropic-temperature-out-of-range", post(MESSAGES, chat(temperature=1.5)), 400,
             "anthropic"),
        Case("anthropic-messages-empty", post(MESSAGES, chat(messages=[])), 400, "anthropic"),
        Case("anthropic-role-system-in-messages", post(MESSAGES, chat(
            messages=[{"role": "system", "content": "hi"}])), 400, "anthropic"),
        Case("anthropic-model-absolute-path", post(MESSAGES, chat(model="/etc/passwd")), 200,
             "anthropic"),
        Case("anthropic-body-10MB-announced", request_bytes(
            "POST", MESSAGES, b"{", content_length=ten_mb), 413, "anthropic"),
        Case("anthropic-nested-1000-levels", deep(MESSAGES, chat()), 400, "anthropic"),
        Case("anthropic-top-k-huge", post(MESSAGES, chat(temperature=1.0, top_k=2**31)), 200,
             "anthropic"),
        Case("count-tokens-wrong-type", post(f"{MESSAGES}/count_tokens",
                                             {"model": model, "messages": 5}), 400, "anthropic"),
        # Other routes, and HTTP that no client library would send.
        Case("completions-two-prompts", post("/v1/completions", {
            "model": model, "prompt": ["a", "b"], "max_tokens": ANSWER_TOKENS}), 400, "openai"),
        Case("responses-previous-id", post("/v1/responses", {
            "model": model, "input": "hi", "previous_response_id": "resp_1"}), 400, "openai"),
        Case("actors-dot-dot", request_bytes("GET", "/actors/..%2f.."), 404, "openai"),
        Case("actors-dot-dot-encoded", request_bytes("GET", "/actors/%2e%2e%2f%2e%2e%2fetc"),
             404, "openai"),
        Case("wrong-method", request_bytes("GET", CHAT), 405, "openai"),
        Case("unknown-route", post("/v1/nope", chat()), 404, "openai"),
        Case("garbage-request-line", b"\x16\x03\x01 <hello> /x\r\n\r\n", 400, "openai"),
        Case("header-100KB", request_bytes("GET", "/v1/models",
                                           headers=(b"X-Big: " + b"a" * 100_000,)), 431, "openai"),
        Case("nul-in-header", request_bytes("GET", "/v1/models", headers=(b"X-A: a\x00b",)),
             400, "openai"),
        Case("content-length-minus-1", b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\n"
             b"Connection: close\r\nContent-Length: -1\r\n\r\n", 400, "openai"),
        Case("bad-chunk-size", b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\n"
             b"Connection: close\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
             400, "openai"),
    ]
    names = [case.name for case in cases]
    assert len(set(names)) == len(names), "corpus case names must be unique"
    return cases


def error_shape_problem(shape: Shape, status: int, body: Any) -> str | None:
    """Why ``body`` is not the error body of ``status`` in ``shape``; None when it is."""
    if shape == "anthropic":
        if not isinstance(body, dict) or body.get("type") != "error":
            return "not Anthropic's error shape"
        error = body.get("error")
        if not isinstance(error, dict) or set(error) != {"type", "message"}:
            return "Anthropic's error without exactly type and message"
        expected = ANTHROPIC_TYPES.get(status)
        if expected is not None and error["type"] != expected:
            return f"Anthropic type {error['type']!r}, expected {expected!r}"
        return None
    if not isinstance(body, dict) or set(body) != {"error"}:
        return "not OpenAI's error shape"
    error = body["error"]
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return "OpenAI's error without exactly message, type, param and code"
    if not isinstance(error["message"], str) or not error["message"]:
        return "an error without a message"
    return None


# api/errors.py's mapping, restated: the soak checks the server against it from outside.
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "api_error",
    503: "overloaded_error",
}
