"""``GET /openapi.json``: an OpenAPI 3.1 document of every route the application serves.

The document is generated, never written by hand: request bodies and answers are the JSON
Schemas of the very msgspec Structs the handlers decode and encode
(``msgspec.json.schema_components``), and the paths are read from the application's router,
so a route added, removed or changed shows up here with no one remembering to. What a Struct
cannot say (which statuses a route answers, that a stream is ``text/event-stream``, the
error shape of Anthropic's routes) is the table ``_OPERATIONS`` below; a route missing from
it is still listed, with a bare description (tests/test_openapi.py fails on that).

The document is built once per application, on its first request, and served as bytes.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from troupe.actors.config import ServeConfig
from troupe.api import anthropic, embeddings, ollama, openai, responses
from troupe.api.errors import AnthropicErrorBody, ErrorBody, OllamaErrorBody, shape_for
from troupe.runtime import ActorSnapshot

OPENAPI_PATH = "/openapi.json"
_REF = "#/components/schemas/{name}"
_JSON = "application/json"
_SSE = "text/event-stream"
_NDJSON = "application/x-ndjson"

# What each error status means on this server (the body says more, in the route's shape).
_ERROR_MEANINGS = {
    400: "The request is invalid: a body that is not JSON or does not fit the schema, or a "
    "value this server refuses (the message and `param` say which).",
    401: "The API key is missing or wrong (only when the server runs with one).",
    403: "The route is an operator's and wants the admin API key, not the API key (only when "
    "the server runs with both).",
    404: "The model named is not served here, the actor named does not exist, or the "
    "response named is not stored.",
    408: "The request body did not arrive in time.",
    413: "The request body is larger than the server's limit (`--max-body-bytes`).",
    429: "The server is busy: its queue is full. Retry after `Retry-After` seconds.",
    500: "An unexpected failure on the server (logged with its traceback).",
    503: "The server is stopping, or the model cannot take the request right now.",
}
# What a POST route that reads a JSON body and asks admission can answer besides 200.
_BODY_ERRORS = (400, 404, 408, 413, 429, 500, 503)
# A route that only asks admission (no body): admission may be busy or gone.
_ADMISSION_ERRORS = (429, 500, 503)

_WARNING = {
    "Warning": {
        "description": "Names the tools of the request this server cannot run (hosted tools "
        "such as `web_search`), which were dropped: `299 mlx-troupe \"tools this server "
        "cannot run were dropped: web_search\"`.",
        "schema": {"type": "string"},
    }
}

_RETRY_AFTER = {
    "Retry-After": {
        "description": "Whole seconds to wait before retrying.",
        "schema": {"type": "integer", "minimum": 0},
    }
}


@dataclass(frozen=True)
class _Operation:
    """What the router cannot tell about one route: its body, answers and statuses."""

    summary: str
    description: str = ""
    # The Struct the handler decodes the JSON body into (None: the route reads no body).
    request: type | None = None
    # The 200 answer: a Struct type, a literal JSON Schema, or None for a non-JSON answer.
    response: type | dict[str, Any] | None = None
    # The 200 answer's media type when it is not JSON (text, HTML, a stream).
    media_type: str = _JSON
    # A route that can answer as server-sent events too: what each event's data can be
    # (Structs, or literal JSON Schemas with Structs in them).
    stream: tuple[type | dict[str, Any], ...] | None = None
    stream_description: str = ""
    # The stream's last event is ``data: [DONE]`` (OpenAI's), which is not JSON.
    done: bool = False
    # The stream is newline-delimited JSON (Ollama's), each line one of ``stream``.
    ndjson: bool = False
    errors: tuple[int, ...] = (500,)
    # Other statuses than 200 that are not failures (a redirect), with their answers.
    extra: dict[str, Any] = field(default_factory=dict)
    # An operator's route (introspection): with an admin key set, it wants that key.
    operator: bool = False
    # Headers the 200 answer may carry.
    headers: dict[str, Any] = field(default_factory=dict)


# The Responses API's stream events are plain dicts (api/responses.py ``_event``): their
# common fields, and the Structs the lifecycle, item and content-part events carry.
_RESPONSES_EVENT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "type": {"type": "string"},
        "sequence_number": {"type": "integer", "minimum": 0},
        "response": responses.ResponseObject,
        "output_index": {"type": "integer", "minimum": 0},
        "content_index": {"type": "integer", "minimum": 0},
        "item_id": {"type": "string"},
        "item": {"anyOf": [responses.MessageItem, responses.ReasoningItem,
                           responses.FunctionCallItem, responses.CustomToolCallItem,
                           responses.LocalShellCallItem]},
        "part": {"anyOf": [responses.OutputText, responses.ReasoningText]},
        "delta": {"type": "string"},
        "text": {"type": "string"},
        "name": {"type": "string"},
        "arguments": {"type": "string"},
        "input": {"type": "string"},
    },
    "required": ["type", "sequence_number"],
}

_OPERATIONS: dict[tuple[str, str], _Operation] = {
    ("POST", "/v1/chat/completions"): _Operation(
        summary="Chat completion (OpenAI)",
        description="A chat answered whole, or as server-sent events with `stream: true`.",
        request=openai.ChatCompletionRequest,
        response=openai.ChatCompletion,
        stream=(openai.ChatCompletionChunk, ErrorBody),
        done=True,
        stream_description="`data: <chat.completion.chunk>` events, then `data: [DONE]`. A "
        "failure after the stream began is a `data: <error>` event (OpenAI's error shape), "
        "then `data: [DONE]`.",
        errors=_BODY_ERRORS,
    ),
    ("POST", "/v1/completions"): _Operation(
        summary="Text completion (OpenAI, legacy)",
        description="A raw-text prompt answered whole, or as server-sent events with "
        "`stream: true`.",
        request=openai.CompletionRequest,
        response=openai.Completion,
        stream=(openai.Completion, ErrorBody),
        done=True,
        stream_description="`data: <text_completion>` events, then `data: [DONE]`. A failure "
        "after the stream began is a `data: <error>` event, then `data: [DONE]`.",
        errors=_BODY_ERRORS,
    ),
    ("POST", "/v1/embeddings"): _Operation(
        summary="Embeddings (OpenAI)",
        description="Unit vectors of `input` (a string, a list of strings, a list of token "
        "ids or a list of lists) from an embedding model; `dimensions` shortens them and "
        "scales them back to unit length, `encoding_format: base64` sends little-endian "
        "float32s. Extensions: `input_type: query` puts the model's query prompt first, "
        "`truncate: true` cuts an input over the context instead of refusing it.",
        request=embeddings.EmbeddingRequest,
        response=embeddings.EmbeddingResponse,
        errors=_BODY_ERRORS,
    ),
    **{("POST", path): _Operation(
        summary="Rerank documents (Cohere/Jina)",
        description="Each of `documents` scored against `query` by a reranker model, best "
        "first, each with its `index`; `top_n` keeps the best n, `return_documents` echoes "
        "their text. Extensions: `instruction` (the reranker's task line), `truncate`.",
        request=embeddings.RerankRequest,
        response=embeddings.RerankResponse,
        errors=_BODY_ERRORS,
    ) for path in ("/v1/rerank", "/rerank", "/v2/rerank")},
    ("GET", "/v1/models"): _Operation(
        summary="The models served (OpenAI)",
        description="With an `anthropic-version` header (Anthropic's clients send one), the "
        "list is in Anthropic's shape: `data` of `{type: model, id, display_name, "
        "created_at, ...}`, `has_more`, `first_id`, `last_id`.",
        response=openai.ModelList,
        errors=_ADMISSION_ERRORS,
    ),
    ("GET", "/v1/models/{model}"): _Operation(
        summary="One model (OpenAI)",
        description="The model a request naming `model` is served by, under that name "
        "(`root` names the served model); in Anthropic's shape with an `anthropic-version` "
        "header. 404 where a request naming it would get one.",
        response=openai.ModelObject,
        errors=(404, *_ADMISSION_ERRORS),
    ),
    ("POST", "/v1/messages"): _Operation(
        summary="Message (Anthropic)",
        description="A conversation answered whole, or as server-sent events with "
        "`stream: true`. Errors are in Anthropic's shape.",
        request=anthropic.MessagesRequest,
        response=anthropic.Message,
        stream=(
            anthropic.MessageStart,
            anthropic.ContentBlockStart,
            anthropic.ContentBlockDelta,
            anthropic.ContentBlockEvent,
            anthropic.MessageDelta,
            anthropic.Bare,
            AnthropicErrorBody,
        ),
        stream_description="`event: <type>` then `data: <json>` whose `type` is the event's "
        "name: `message_start`, `ping`, then per content block `content_block_start`, "
        "`content_block_delta`..., `content_block_stop`; then `message_delta` and "
        "`message_stop`. A failure after the stream began is an `error` event.",
        errors=_BODY_ERRORS,
    ),
    ("POST", "/v1/messages/count_tokens"): _Operation(
        summary="Count a conversation's prompt tokens (Anthropic)",
        description="The prompt's size as this server's model would see it, without "
        "generating. Errors are in Anthropic's shape.",
        request=anthropic.CountTokensRequest,
        response=anthropic.TokenCount,
        errors=_BODY_ERRORS,
    ),
    ("POST", "/v1/responses"): _Operation(
        summary="Response (OpenAI Responses API)",
        description="A Responses request answered whole, or as server-sent events with "
        "`stream: true`. The answer is stored (in memory, the last `--responses-store`) "
        "unless `store: false`; `previous_response_id` continues a stored one (404 when it "
        "is not kept). Hosted tools this server cannot run are dropped and named in a "
        "`Warning` header. `conversation` and `background: true` are refused with 400.",
        request=responses.ResponsesRequest,
        response=responses.ResponseObject,
        stream=(_RESPONSES_EVENT, ErrorBody),
        stream_description="`event: <type>` then `data: <json>` with that `type` and a "
        "`sequence_number`: `response.created`, `response.in_progress`, then per output item "
        "`response.output_item.added`, its content and delta events, "
        "`response.output_item.done`; the last is `response.completed`, "
        "`response.incomplete` or `response.failed`. Lifecycle events carry the response "
        "object (schema below) in `response`.",
        errors=_BODY_ERRORS,
        headers=_WARNING,
    ),
    ("GET", "/v1/responses/{response_id}"): _Operation(
        summary="A stored response (OpenAI Responses API)",
        description="The response as it was answered, while the server keeps it.",
        response=responses.ResponseObject,
        errors=(404, 500),
    ),
    ("DELETE", "/v1/responses/{response_id}"): _Operation(
        summary="Forget a stored response (OpenAI Responses API)",
        response=responses.DeletedResponse,
        errors=(404, 500),
    ),
    ("POST", "/api/chat"): _Operation(
        summary="Chat (Ollama)",
        description="A chat streamed as newline-delimited JSON, or answered whole with "
        "`stream: false`. `options` carry the sampling settings (`temperature`, `top_p`, "
        "`top_k`, `min_p`, `seed`, `num_predict`, `stop`, `repeat_penalty`; load-time ones "
        "such as `num_ctx` are ignored); `format` is \"json\" or a JSON Schema; `think` the "
        "template's thinking switch. Errors are `{\"error\": ...}`.",
        request=ollama.OllamaChatRequest,
        response=ollama.OllamaChatChunk,
        stream=(ollama.OllamaChatChunk, OllamaErrorBody),
        ndjson=True,
        stream_description="One object a line: deltas with `done: false`, then one with "
        "`done: true`, `done_reason` and the counts and durations (ns). A failure after the "
        "stream began is a last line `{\"error\": ...}`.",
        errors=_BODY_ERRORS,
    ),
    ("POST", "/api/generate"): _Operation(
        summary="Generate (Ollama)",
        description="A prompt (through the chat template, with `system`; as it is with "
        "`raw: true`) streamed as newline-delimited JSON, or answered whole with "
        "`stream: false`. `suffix`, `template` and `context` are refused.",
        request=ollama.OllamaGenerateRequest,
        response=ollama.OllamaGenerateChunk,
        stream=(ollama.OllamaGenerateChunk, OllamaErrorBody),
        ndjson=True,
        stream_description="One object a line, `response` the text's delta; the last has "
        "`done: true`, `done_reason`, the counts and durations (ns).",
        errors=_BODY_ERRORS,
    ),
    ("POST", "/api/embed"): _Operation(
        summary="Embeddings (Ollama)",
        description="Unit vectors of `input` (a string or a list of strings) from an "
        "embedding model; inputs over the context are cut unless `truncate: false`.",
        request=ollama.OllamaEmbedRequest,
        response=ollama.OllamaEmbedResponse,
        errors=_BODY_ERRORS,
    ),
    ("POST", "/api/embeddings"): _Operation(
        summary="One embedding (Ollama, older)",
        request=ollama.OllamaEmbeddingsRequest,
        response=ollama.OllamaEmbeddingsResponse,
        errors=_BODY_ERRORS,
    ),
    ("GET", "/api/tags"): _Operation(
        summary="The models served (Ollama)",
        response=ollama.OllamaModelsResponse,
        errors=_ADMISSION_ERRORS,
    ),
    ("GET", "/api/ps"): _Operation(
        summary="The models loaded (Ollama): every served model stays loaded",
        response=ollama.OllamaModelsResponse,
        errors=_ADMISSION_ERRORS,
    ),
    ("POST", "/api/show"): _Operation(
        summary="One model's details (Ollama)",
        description="Its family, context length (`model_info`), chat template and "
        "`capabilities` (`completion`, `tools`, `vision`; `embedding`).",
        request=ollama.OllamaShowRequest,
        response=ollama.OllamaShowResponse,
        errors=_BODY_ERRORS,
    ),
    ("GET", "/api/version"): _Operation(
        summary="The Ollama release whose API these routes follow",
        response=ollama.OllamaVersionResponse,
    ),
    ("GET", "/health"): _Operation(
        summary="Liveness",
        description="200 while the server accepts requests; 503 while it stops or when its "
        "admission actor is not running. Never needs the API key.",
        response={
            "type": "object",
            "properties": {"status": {"const": "ok"}},
            "required": ["status"],
        },
        errors=(500, 503),
    ),
    ("GET", "/metrics"): _Operation(
        summary="Prometheus metrics",
        description="The Prometheus text exposition format.",
        media_type="text/plain",
        operator=True,
    ),
    ("GET", "/actors"): _Operation(
        summary="Every actor's snapshot, live",
        description="The actor system's actors in spawn order; each `report` is whatever the "
        "actor reports (values JSON cannot hold are shown as text).",
        response={"type": "array", "items": ActorSnapshot},
        operator=True,
    ),
    ("GET", "/actors/{name}"): _Operation(
        summary="One actor's snapshot, live",
        response=ActorSnapshot,
        errors=(404, 500),
        operator=True,
    ),
    ("GET", "/actors/events"): _Operation(
        summary="The dashboard's live stream",
        description="Snapshots of the whole server as server-sent events (`event: snapshot`) "
        "until the client leaves or the server stops; it starts with a `retry:` line.",
        media_type=_SSE,
        stream=({"type": "object"},),
        stream_description="`event: snapshot`, its data the whole server's state (actors, "
        "requests, cache, memory, models, recent throughput).",
        operator=True,
    ),
    ("GET", "/"): _Operation(
        summary="To the dashboard",
        extra={
            "302": {
                "description": "A redirect to `/dashboard`.",
                "headers": {"Location": {"schema": {"type": "string"}, "required": True}},
            }
        },
    ),
    ("GET", "/dashboard"): _Operation(
        summary="The live dashboard's page",
        description="An HTML page reading `/actors/events`; needs no API key (it holds no "
        "data; its stream does).",
        media_type="text/html",
    ),
    ("GET", OPENAPI_PATH): _Operation(
        summary="This document",
        description="OpenAPI 3.1, generated from the routes and their msgspec Structs.",
        response={"type": "object"},
    ),
}

# The dashboard's script and stylesheet: served as files, described by their extension.
_FILE_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}


def _version() -> str:
    try:
        return importlib.metadata.version("mlx-troupe")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout not installed
        return "0.0.0"


def _routes(router: web.UrlDispatcher) -> list[tuple[str, str]]:
    """Every (method, path template) the router serves, in registration order.

    HEAD, which aiohttp adds beside every GET and answers like it, is left out (the
    document says so once); so are ``*`` routes, which would say nothing."""
    found: list[tuple[str, str]] = []
    for resource in router.resources():
        path = resource.canonical
        for route in resource:
            if route.method not in ("HEAD", "*") and (route.method, path) not in found:
                found.append((route.method, path))
    return found


def _operation_for(method: str, path: str) -> _Operation | None:
    """The table's entry, or one for a file the dashboard serves; None: not described."""
    if (method, path) in _OPERATIONS:
        return _OPERATIONS[(method, path)]
    suffix = "." + path.rpartition(".")[2]
    if method == "GET" and path.startswith("/dashboard/") and suffix in _FILE_TYPES:
        return _Operation(summary=f"The dashboard's {path.rpartition('/')[2]}",
                          media_type=_FILE_TYPES[suffix])
    return None


class _Schemas:
    """One ``schema_components`` call for every Struct the document mentions.

    The Structs are gathered first (``ref`` hands back a placeholder) and resolved together,
    so a Struct two routes share is one component, and two Structs with one name (the
    ``Tool`` of Anthropic's API and of the Responses API) get distinct, qualified names.
    """

    def __init__(self) -> None:
        self.types: list[type] = []

    def ref(self, kind: type) -> dict[str, Any]:
        if kind not in self.types:
            self.types.append(kind)
        return {"$struct": self.types.index(kind)}

    def schema(self, spec: Any) -> Any:
        """``spec`` as a JSON Schema: a Struct's reference, or a literal one with Structs in."""
        if isinstance(spec, type):
            return self.ref(spec)
        if isinstance(spec, dict):
            return {k: self.schema(v) for k, v in spec.items()}
        if isinstance(spec, list):
            return [self.schema(v) for v in spec]
        return spec

    def resolve(self, document: dict[str, Any]) -> dict[str, Any]:
        """Replace the placeholders with references and add the components."""
        refs, components = msgspec.json.schema_components(self.types, ref_template=_REF)

        def walk(node: Any) -> Any:
            if isinstance(node, dict):
                if "$struct" in node:
                    return refs[node["$struct"]]
                return {k: walk(v) for k, v in node.items()}
            if isinstance(node, list):
                return [walk(v) for v in node]
            return node

        resolved = walk(document)
        resolved.setdefault("components", {})["schemas"] = dict(sorted(components.items()))
        return resolved


_ERROR_BODIES = {"anthropic": AnthropicErrorBody, "ollama": OllamaErrorBody, "openai": ErrorBody}


def _error_response(status: int, path: str, schemas: _Schemas) -> dict[str, Any]:
    body = _ERROR_BODIES[shape_for(path)]
    answer: dict[str, Any] = {
        "description": _ERROR_MEANINGS.get(status, "A failure."),
        "content": {_JSON: {"schema": schemas.ref(body)}},
    }
    if status in (429, 503):
        answer["headers"] = _RETRY_AFTER
    return answer


def _event_schema(op: _Operation, schemas: _Schemas) -> dict[str, Any]:
    """One server-sent event, read as OpenAPI 3.2's ``itemSchema`` (and Schemathesis) read a
    stream in 3.1: an object of the event's fields, its ``data`` a string holding JSON."""
    assert op.stream is not None
    data: dict[str, Any] = {
        "type": "string",
        "contentMediaType": _JSON,
        "contentSchema": {"anyOf": [schemas.schema(kind) for kind in op.stream]},
    }
    if op.done:
        data = {"anyOf": [{"const": "[DONE]"}, data]}
    return {
        "type": "object",
        "description": op.stream_description,
        "properties": {
            "event": {"type": "string"},
            "data": data,
            "id": {"type": "string"},
            "retry": {"type": "integer", "minimum": 0},
        },
    }


def _ok_response(op: _Operation, schemas: _Schemas) -> dict[str, Any]:
    content: dict[str, Any] = {}
    if op.media_type == _JSON:
        schema = schemas.schema(op.response) if op.response is not None else {}
        content[_JSON] = {"schema": schema}
    elif op.media_type != _SSE:
        content[op.media_type] = {"schema": {"type": "string"}}
    if op.stream is not None and op.ndjson:
        content[_NDJSON] = {"schema": {
            "type": "string", "description": op.stream_description,
            "x-line-schema": {"anyOf": [schemas.schema(kind) for kind in op.stream]}}}
    elif op.stream is not None:
        content[_SSE] = {"schema": _event_schema(op, schemas)}
    description = "The answer."
    if op.ndjson:
        description = ("The answer as newline-delimited JSON (streamed, the default), or whole "
                       "(JSON) with `stream: false`.")
    elif op.media_type == _JSON and op.stream is not None:
        description = "The whole answer (JSON), or with `stream: true` its server-sent events."
    answer: dict[str, Any] = {"description": description, "content": content}
    if op.headers:
        answer["headers"] = op.headers
    return answer


def _operation(
    method: str, path: str, *, keys: _Keys, schemas: _Schemas
) -> dict[str, Any]:
    op = _operation_for(method, path)
    if op is None:
        # Listed so that no route is hidden; tests/test_openapi.py asks for a real entry.
        return {
            "summary": f"{method} {path}",
            "x-undescribed": True,
            "responses": {"default": {"description": "Not described yet."}},
        }
    out: dict[str, Any] = {"summary": op.summary}
    if op.description:
        out["description"] = op.description
    out["operationId"] = _operation_id(method, path)
    parameters = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in _path_parameters(path)
    ]
    if parameters:
        out["parameters"] = parameters
    if op.request is not None:
        out["requestBody"] = {
            "required": True,
            "content": {_JSON: {"schema": schemas.ref(op.request)}},
        }
    answers: dict[str, Any] = {}
    if not op.extra:
        answers["200"] = _ok_response(op, schemas)
    answers.update(op.extra)
    refusals = keys.refusals(path, operator=op.operator)
    statuses = set(op.errors) | refusals
    for status in sorted(statuses):
        answers[str(status)] = _error_response(status, path, schemas)
    out["responses"] = answers
    # Which routes want the key depends on how the server was started: this one's answer.
    out["security"] = [{"bearerKey": []}, {"headerKey": []}] if refusals else []
    return out


def _operation_id(method: str, path: str) -> str:
    """``post_v1_chat_completions``, ``get_actors_name``; ``get_root`` for ``/``."""
    words = re.findall(r"[A-Za-z0-9]+", path)
    return "_".join([method.lower(), *(words or ["root"])])


def _path_parameters(path: str) -> list[str]:
    return [part[1:-1] for part in path.split("/") if part.startswith("{") and part.endswith("}")]


@dataclass(frozen=True)
class _Keys:
    """Which API keys the server was started with, and the paths that never want one."""

    api: bool = False
    admin: bool = False
    open_paths: frozenset[str] = frozenset()

    def refusals(self, path: str, *, operator: bool) -> set[int]:
        """What the key check can answer on ``path`` (as api/app.py's middleware decides):
        401 for a missing or wrong key; on an operator's route with both keys set, 403 for
        the API key. Without an API key, only the operator's routes want one (the admin's).
        """
        if path in self.open_paths or not (self.api or (self.admin and operator)):
            return set()
        return {401, 403} if operator and self.admin and self.api else {401}


def build_document(
    routes: Iterable[tuple[str, str]],
    *,
    api_key: bool = False,
    admin_key: bool = False,
    open_paths: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """The OpenAPI document of ``routes`` ((method, path template) pairs).

    ``api_key``, ``admin_key``: the server was started with that key, so every path but
    ``open_paths`` may answer 401 (and, with an admin key, 403).
    """
    keys = _Keys(api=api_key, admin=admin_key, open_paths=open_paths)
    schemas = _Schemas()
    paths: dict[str, dict[str, Any]] = {}
    for method, path in routes:
        paths.setdefault(path, {})[method.lower()] = _operation(
            method, path, keys=keys, schemas=schemas
        )
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "mlx-troupe",
            "version": _version(),
            "description": "OpenAI's and Anthropic's APIs, served by mlx-troupe. Generated from "
            "the server's routes and the msgspec Structs of their requests and answers. Every "
            "GET route answers HEAD too. Unknown request fields are ignored.",
        },
        "paths": paths,
        "components": {
            "securitySchemes": {
                "bearerKey": {"type": "http", "scheme": "bearer",
                              "description": "The API key, as OpenAI clients send it."},
                "headerKey": {"type": "apiKey", "in": "header", "name": "x-api-key",
                              "description": "The API key, as Anthropic clients send it."},
            }
        },
    }
    return schemas.resolve(document)


class OpenApiRoute:
    """``GET /openapi.json`` for one application: its document, built on the first request.

    Built lazily because the router is complete only once the application has started, and
    once because it cannot change after that (aiohttp freezes it).
    """

    def __init__(self, config: ServeConfig, *, open_paths: frozenset[str]) -> None:
        # Which routes want a key is decided when the server starts: this server's answer.
        self.api_key = bool(config.api_key)
        self.admin_key = bool(config.admin_api_key)
        self.open_paths = open_paths
        self.body: bytes | None = None

    def register(self, router: web.UrlDispatcher) -> None:
        """Add the route to an application's router."""
        router.add_get(OPENAPI_PATH, self.handle)

    def document(self, router: web.UrlDispatcher) -> bytes:
        """The document of ``router``'s routes, as JSON."""
        if self.body is None:
            routes = _routes(router)
            document = build_document(routes, api_key=self.api_key, admin_key=self.admin_key,
                                      open_paths=self.open_paths)
            self.body = msgspec.json.encode(document)
        return self.body

    async def handle(self, request: web.Request) -> web.Response:
        """``GET /openapi.json``."""
        return web.Response(body=self.document(request.app.router), content_type=_JSON)
