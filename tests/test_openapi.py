"""``GET /openapi.json`` (api/openapi.py), and Schemathesis against it and the real app.

The app is the real one (``create_app``, middlewares, error shapes, ``start_http``'s protocol)
on the scripted admission of tests/http_stack.py, served on 127.0.0.1 from a loop in a thread
of its own: Schemathesis calls it with ``requests`` from the test's thread, so neither waits
on the other's loop. Every answer must be 2xx (or the dashboard's redirect) or a 4xx in the
route's error shape, and match the document: status, media type, headers, body schema, and
each server-sent event of a stream. Never a 5xx, never a hung request.

The fuzzing is Hypothesis through Schemathesis's strategies (``APIOperation.as_strategy``)
with explicit, derandomized settings: the same cases every run, a bounded count, and checks
named here rather than a plugin's defaults.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import requests
import schemathesis
from http_stack import BUSY_MODEL, MODEL, STOP, scripted_system
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from troupe.actors.config import ServeConfig
from troupe.api import anthropic, openai, responses
from troupe.api.errors import AnthropicErrorBody, ErrorBody
from troupe.api.openapi import OPENAPI_PATH, OpenApiRoute, build_document
from troupe.api.server import HttpServer

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
# The same, for a scripted 503 (a failure the script asks for).
CONFORMANCE = CHECKS[1:]
# A request that takes longer than this (connect, or between two bytes) is a hung request.
CALL_TIMEOUT_S = 10.0
# Cases per operation: enough to reach every route's refusals and answers, bounded in time
# (generating bodies for the large request schemas is the slow part).
POSITIVE_EXAMPLES = 8
NEGATIVE_EXAMPLES = 5
FUZZ_SETTINGS = settings(
    derandomize=True,  # the same cases every run: CI is deterministic
    database=None,
    deadline=None,  # the time a case takes is the server's business, bounded by the timeout
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.data_too_large,
    ],
    # No shrinking: it would replay requests for as long as it finds smaller failures. A
    # failure shows its case as a curl command, the same every run.
    phases=[Phase.explicit, Phase.generate],
)
# Streams forever (the dashboard's): checked on its own below, never fuzzed.
ENDLESS = "/actors/events"
API_KEY = "sk-openapi-test"


@dataclass
class Served:
    """The app on the scripted admission, served on 127.0.0.1 by a loop in its own thread."""

    url: str
    server: HttpServer
    document: dict[str, Any]
    schema: Any  # schemathesis's OpenApiSchema


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with _serving() as stack:
        yield stack


@pytest.fixture(scope="module")
def served_keyed() -> Iterator[Served]:
    with _serving(api_key=API_KEY) as stack:
        yield stack


class _Serving:
    """``Scripted.start()`` on a loop of its own, in a thread, until ``stop`` is set."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.stop: asyncio.Event | None = None
        self.server: HttpServer | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="openapi-server", daemon=True)

    def _run(self) -> None:
        try:
            self.loop.run_until_complete(self._main())
        except BaseException as exc:  # handed to the test's thread
            self.error = exc
            self.ready.set()
        finally:
            self.loop.close()

    async def _main(self) -> None:
        async with scripted_system() as stack:
            # A short grace: nothing is in flight when the module's tests are done.
            self.server = await stack.start(shutdown_grace=1.0, **self.fields)
            self.stop = asyncio.Event()
            self.ready.set()
            try:
                await self.stop.wait()
            finally:
                await self.server.close()


@contextmanager
def _serving(**fields: Any) -> Iterator[Served]:
    """The scripted app with ``ServeConfig(**fields)``, and its document loaded."""
    serving = _Serving(fields)
    serving.thread.start()
    assert serving.ready.wait(30), "the server did not start in 30 s"
    if serving.error is not None:
        raise serving.error
    assert serving.server is not None and serving.stop is not None
    try:
        url = serving.server.url
        headers = {"x-api-key": fields["api_key"]} if "api_key" in fields else {}
        answer = requests.get(url + OPENAPI_PATH, headers=headers, timeout=CALL_TIMEOUT_S)
        assert answer.status_code == 200, answer.text
        document = answer.json()
        schema = schemathesis.openapi.from_dict(answer.json())  # its own copy: it edits it
        yield Served(url=url, server=serving.server, document=document, schema=schema)
    finally:
        serving.loop.call_soon_threadsafe(serving.stop.set)
        serving.thread.join(30)
        assert not serving.thread.is_alive(), "the server did not stop in 30 s"


def _operations(served: Served) -> list[Any]:
    operations = [result.ok() for result in served.schema.get_all_operations()]
    assert operations
    return operations


def _raw(served: Served, operation: Any) -> dict[str, Any]:
    """The document's own entry for ``operation``."""
    return served.document["paths"][operation.path][operation.method.lower()]


def _call(served: Served, case: Any, session: requests.Session, **kwargs: Any) -> Any:
    # allow_redirects=False: GET / answers its own documented 302, not /dashboard's 200.
    return case.call(
        base_url=served.url, session=session, timeout=CALL_TIMEOUT_S, allow_redirects=False,
        **kwargs,
    )


# --- the document -------------------------------------------------------------------------


def test_the_document_lists_every_route_the_app_serves(served: Served) -> None:
    doc = served.document
    assert doc["openapi"] == "3.1.0"
    listed = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    routed = {
        (route.method, resource.canonical)
        for resource in served.server.app.router.resources()
        for route in resource
        if route.method not in ("HEAD", "*")
    }
    assert listed == routed
    # Each route has a real entry, not the fallback that keeps an unknown route visible.
    undescribed = [
        f"{m.upper()} {p}" for p, ops in doc["paths"].items() for m, op in ops.items()
        if op.get("x-undescribed")
    ]
    assert undescribed == [], "add these routes to api/openapi.py's _OPERATIONS"
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/messages",
                 "/v1/messages/count_tokens", "/v1/responses", "/health", "/actors",
                 "/actors/{name}", "/metrics", OPENAPI_PATH):
        assert path in doc["paths"], path


def test_the_document_is_valid_openapi_and_json_schema(served: Served) -> None:
    served.schema.validate()  # against OpenAPI 3.1's own schema: raises when invalid
    components = served.document["components"]["schemas"]
    for schema in components.values():
        Draft202012Validator.check_schema(schema)
    # Every reference resolves.
    text = json.dumps(served.document)
    for name in {part.split('"')[0] for part in text.split("#/components/schemas/")[1:]}:
        assert name in components, name


def test_the_schemas_are_the_structs_own(served: Served) -> None:
    """What the document says of a body is what msgspec decodes and encodes: no drift."""
    doc = served.document
    ref = "#/components/schemas/{name}"
    for path, kind in [
        ("/v1/chat/completions", openai.ChatCompletionRequest),
        ("/v1/completions", openai.CompletionRequest),
        ("/v1/messages", anthropic.MessagesRequest),
        ("/v1/messages/count_tokens", anthropic.CountTokensRequest),
        ("/v1/responses", responses.ResponsesRequest),
    ]:
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"] == {"$ref": ref.format(name=kind.__name__)}
    structs = [openai.ChatCompletionRequest, openai.ChatCompletion, openai.ModelList,
               anthropic.Message, anthropic.MessagesRequest, responses.ResponsesRequest,
               responses.ResponseObject, ErrorBody, AnthropicErrorBody]
    _, expected = msgspec.json.schema_components(structs, ref_template=ref)
    for name, schema in expected.items():
        # Two Tools (Anthropic's, the Responses API's) are told apart by their module, here
        # as in the document: both requests are in ``structs``.
        assert doc["components"]["schemas"][name] == schema, name
    ok = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert ok["application/json"]["schema"] == {"$ref": ref.format(name="ChatCompletion")}
    assert "text/event-stream" in ok
    error = doc["paths"]["/v1/messages"]["post"]["responses"]["400"]["content"]
    assert error["application/json"]["schema"] == {"$ref": ref.format(name="AnthropicErrorBody")}
    error = doc["paths"]["/v1/responses"]["post"]["responses"]["429"]
    assert error["content"]["application/json"]["schema"] == {"$ref": ref.format(name="ErrorBody")}
    assert "Retry-After" in error["headers"]


def test_the_document_is_built_once_and_served_the_same(served: Served) -> None:
    first = requests.get(served.url + OPENAPI_PATH, timeout=CALL_TIMEOUT_S)
    second = requests.get(served.url + OPENAPI_PATH, timeout=CALL_TIMEOUT_S)
    assert first.content == second.content
    assert first.headers["Content-Type"].startswith("application/json")

    class Router:
        calls = 0

        def resources(self) -> list[Any]:
            Router.calls += 1
            return []

    route = OpenApiRoute(ServeConfig(), open_paths=frozenset())
    body = route.document(Router())  # type: ignore[arg-type]
    assert route.document(Router()) is body  # type: ignore[arg-type]
    assert Router.calls == 1


def test_keys_are_documented_only_where_the_server_wants_them() -> None:
    routes = [("GET", "/health"), ("GET", "/actors"), ("POST", "/v1/messages")]
    open_doc = build_document(routes)
    for ops in open_doc["paths"].values():
        for op in ops.values():
            assert "401" not in op["responses"] and op["security"] == []
    keyed = build_document(routes, api_key=True, open_paths=frozenset({"/health"}))
    paths = keyed["paths"]
    assert "401" not in paths["/health"]["get"]["responses"]
    assert paths["/health"]["get"]["security"] == []
    for path, method in [("/actors", "get"), ("/v1/messages", "post")]:
        op = paths[path][method]
        assert "401" in op["responses"] and "403" not in op["responses"]
        assert op["security"] == [{"bearerKey": []}, {"headerKey": []}]
    # With an admin key too, the operator's routes refuse the API key with 403.
    both = build_document(routes, api_key=True, admin_key=True, open_paths=frozenset())
    assert {"401", "403"} <= set(both["paths"]["/actors"]["get"]["responses"])
    assert "403" not in both["paths"]["/v1/messages"]["post"]["responses"]
    # An admin key alone guards the operator's routes only.
    admin = build_document(routes, admin_key=True, open_paths=frozenset())
    assert "401" in admin["paths"]["/actors"]["get"]["responses"]
    assert "401" not in admin["paths"]["/v1/messages"]["post"]["responses"]
    assert admin["paths"]["/v1/messages"]["post"]["security"] == []


# --- the document against the app: scripted answers -------------------------------------------


def _chat(script: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": script}], **extra}


# (route, body): one of each answer the scripted admission plays, whole and streamed.
_SCRIPTED = [
    ("/v1/chat/completions", _chat("hello")),
    ("/v1/chat/completions", _chat("hello", logprobs=True, top_logprobs=2)),
    ("/v1/chat/completions", _chat("tool-call")),
    ("/v1/chat/completions", _chat("reasoning")),
    ("/v1/chat/completions", _chat("length", stream_options={"include_usage": True})),
    ("/v1/chat/completions", _chat("fail-mid-stream")),
    ("/v1/chat/completions", _chat("refuse-before-start")),
    ("/v1/chat/completions", {**_chat("hello"), "model": BUSY_MODEL}),
    ("/v1/chat/completions", {**_chat("hello"), "model": "no-such-model"}),
    ("/v1/completions", {"model": MODEL, "prompt": "hello", "logprobs": 2}),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 3]}),
    ("/v1/completions", {"model": MODEL, "prompt": "fail-mid-stream"}),
    ("/v1/messages", {**_chat("hello"), "max_tokens": 16}),
    ("/v1/messages", {**_chat("tool-call"), "max_tokens": 16}),
    ("/v1/messages", {**_chat("reasoning"), "max_tokens": 16}),
    ("/v1/messages", {**_chat("stop-string"), "max_tokens": 16, "stop_sequences": [STOP]}),
    ("/v1/messages", {**_chat("fail-mid-stream"), "max_tokens": 16}),
    ("/v1/messages", {**_chat("hello"), "max_tokens": 16, "model": BUSY_MODEL}),
    ("/v1/messages/count_tokens", _chat("hello")),
    ("/v1/messages/count_tokens", {**_chat("hello"), "model": "no-such-model"}),
    ("/v1/responses", {"model": MODEL, "input": "hello"}),
    ("/v1/responses", {"model": MODEL, "input": "tool-call"}),
    ("/v1/responses", {"model": MODEL, "input": "reasoning"}),
    ("/v1/responses", {"model": MODEL, "input": "length"}),
    ("/v1/responses", {"model": MODEL, "input": "fail-mid-stream"}),
    ("/v1/responses", {"model": MODEL, "input": "custom-call",
                       "tools": [{"type": "custom", "name": "apply_patch"},
                                 {"type": "web_search"}]}),
    ("/v1/responses", {"model": MODEL, "input": "shell-call", "tools": [{"type": "local_shell"}]}),
    ("/v1/responses", {"model": MODEL, "input": "hello", "background": True}),
    ("/api/chat", _chat("hello", stream=False)),
    ("/api/chat", _chat("tool-call", stream=False)),
    ("/api/chat", _chat("reasoning", stream=False)),
    ("/api/chat", _chat("fail-mid-stream", stream=False)),
    ("/api/chat", {**_chat("hello", stream=False), "model": "no-such-model"}),
    ("/api/generate", {"model": MODEL, "prompt": "length", "stream": False}),
    ("/api/generate", {"model": MODEL, "prompt": "hello", "raw": True, "stream": False}),
    ("/api/embed", {"model": MODEL, "input": ["a", "b"]}),
    ("/api/show", {"model": MODEL}),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_every_scripted_answer_matches_the_document(served: Served, stream: bool) -> None:
    session = requests.Session()
    statuses = set()
    for path, body in _SCRIPTED:
        operation = served.schema[path]["POST"]
        if stream and path not in ("/v1/messages/count_tokens", "/api/embed", "/api/show"):
            body = {**body, "stream": True}
        case = operation.Case(body=body, media_type="application/json")
        answer = _call(served, case, session)
        statuses.add(answer.status_code)
        # The scripted failures are 503 (out of memory mid-request), never a 500.
        assert answer.status_code < 500 or answer.status_code == 503, (path, answer.text)
        if stream and answer.status_code == 200 and "stream" in body:
            # Ollama's routes stream newline-delimited JSON.
            media = "application/x-ndjson" if path.startswith("/api/") else "text/event-stream"
            assert answer.headers["content-type"][0].startswith(media), path
            if media == NDJSON:
                _check_lines(served, path, answer.text)
        case.validate_response(answer, checks=CONFORMANCE)
    assert {200, 400, 404, 429} <= statuses


NDJSON = "application/x-ndjson"


def _check_lines(served: Served, path: str, body: str) -> None:
    """Every line of an NDJSON answer is one of the objects the document says a line is."""
    content = served.document["paths"][path]["post"]["responses"]["200"]["content"]
    line = {**content[NDJSON]["schema"]["x-line-schema"],
            "components": served.document["components"]}
    validator = Draft202012Validator(line)
    assert body.endswith("\n") and body.count("\n") >= 2, body
    for text in body.splitlines():
        validator.validate(json.loads(text))


def _path_parameters(path: str, response_id: str) -> dict[str, str]:
    """Path parameters naming what exists: the admission actor, a stored response."""
    if "{name}" in path:
        return {"name": "admission"}
    if "{model}" in path:
        return {"model": MODEL}
    return {"response_id": response_id} if "{response_id}" in path else {}


def test_every_get_route_answers_as_documented(served: Served) -> None:
    session = requests.Session()
    stored = session.post(served.url + "/v1/responses", json={"model": MODEL, "input": "hello"},
                          timeout=CALL_TIMEOUT_S).json()["id"]
    for operation in _operations(served):
        if operation.method.upper() != "GET" or operation.path == ENDLESS:
            continue
        case = operation.Case(path_parameters=_path_parameters(operation.path, stored))
        answer = _call(served, case, session)
        assert answer.status_code in (200, 302), (operation.label, answer.text)
        case.validate_response(answer, checks=CHECKS)


def test_the_endless_stream_answers_as_documented(served: Served) -> None:
    """``/actors/events`` never ends: only its start is read, within a deadline."""
    documented = served.document["paths"][ENDLESS]["get"]["responses"]["200"]["content"]
    with requests.get(served.url + ENDLESS, stream=True, timeout=CALL_TIMEOUT_S) as answer:
        assert answer.status_code == 200
        media_type = answer.headers["Content-Type"].split(";")[0]
        assert media_type in documented
        first = next(answer.iter_lines())
        assert first.startswith(b"retry:")


def test_a_keyed_server_refuses_as_documented(served_keyed: Served) -> None:
    session = requests.Session()
    seen = set()
    for operation in _operations(served_keyed):
        if operation.path == ENDLESS:
            continue
        body = {} if operation.method.upper() == "POST" else None
        case = operation.Case(
            path_parameters=_path_parameters(operation.path, "resp_1"),
            **({"body": body, "media_type": "application/json"} if body is not None else {}),
        )
        answer = _call(served_keyed, case, session)
        seen.add(answer.status_code)
        documented = _raw(served_keyed, operation)["responses"]
        assert (answer.status_code == 401) == ("401" in documented), operation.label
        case.validate_response(answer, checks=CHECKS)
    assert 401 in seen


# --- fuzzing ---------------------------------------------------------------------------------


def _fuzz(served: Served, mode: GenerationMode, examples: int) -> dict[str, dict[int, int]]:
    """Run ``examples`` cases of ``mode`` on every operation; the statuses seen, by operation."""
    session = requests.Session()
    seen: dict[str, dict[int, int]] = {}
    for operation in _operations(served):
        if operation.path == ENDLESS:
            continue
        if not mode.is_positive and "requestBody" not in _raw(served, operation):
            continue  # nothing to make invalid: a string path parameter takes any string
        _fuzz_operation(served, operation, mode, examples, session,
                        seen.setdefault(operation.label, {}))
    return seen


def _fuzz_operation(
    served: Served,
    operation: Any,
    mode: GenerationMode,
    examples: int,
    session: requests.Session,
    counts: dict[int, int],
) -> None:
    @settings(FUZZ_SETTINGS, max_examples=examples)
    @given(case=operation.as_strategy(generation_mode=mode), served_model=st.booleans())
    def run(case: Any, served_model: bool) -> None:
        if served_model and isinstance(case.body, dict) and mode.is_positive:
            # Half the cases name the model served, so they reach admission and the
            # renderers; the others mostly meet the 404 of an unknown model.
            case.body["model"] = MODEL
        if case.path_parameters.get("name") == "events":
            return  # /actors/events: the endless stream, checked on its own
        started = time.monotonic()
        answer = _call(served, case, session)
        note(f"{operation.label} -> {answer.status_code} {answer.text[:300]!r}")
        counts[answer.status_code] = counts.get(answer.status_code, 0) + 1
        assert time.monotonic() - started < CALL_TIMEOUT_S
        if not mode.is_positive:
            # A body that breaks the schema is refused; 413 when it is also too large.
            assert 400 <= answer.status_code < 500, answer.text[:300]
        case.validate_response(answer, checks=CHECKS)

    run()


def test_fuzzing_valid_requests_gets_only_documented_answers(served: Served) -> None:
    seen = _fuzz(served, GenerationMode.POSITIVE, POSITIVE_EXAMPLES)
    statuses = {status for counts in seen.values() for status in counts}
    assert all(status < 500 for status in statuses), seen
    assert 200 in statuses and 400 in statuses, seen


def test_fuzzing_invalid_requests_gets_only_documented_refusals(served: Served) -> None:
    seen = _fuzz(served, GenerationMode.NEGATIVE, NEGATIVE_EXAMPLES)
    assert seen
