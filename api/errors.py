"""Failures in the route's API error shape: OpenAI's, or Anthropic's on ``/v1/messages``.

OpenAI: ``{"error": {"message", "type", "param", "code"}}``. Anthropic:
``{"type": "error", "error": {"type", "message"}}``. Every failure the HTTP layer answers
leaves through here: refusals from admission, bad request bodies, missing API keys, aiohttp's
own 404/405/413, and unexpected exceptions (500, logged with traceback).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Literal

import msgspec
from aiohttp import web
from aiohttp.typedefs import Handler

from troupe.actors.messages import AdmissionError, ErrorKind
from troupe.runtime import ActorDead, ActorRef, AskTimeout, MailboxFull, Message

log = logging.getLogger(__name__)

# Admission may load a model on demand before it answers, which can take minutes.
ADMISSION_TIMEOUT_S = 600.0
# How long a client should wait after a 429 whose cause did not say.
DEFAULT_RETRY_AFTER_S = 1.0

Shape = Literal["openai", "anthropic", "ollama"]

# Anthropic's routes and Ollama's; everything else answers in OpenAI's shape.
ANTHROPIC_PREFIX = "/v1/messages"
OLLAMA_PREFIX = "/api/"


# Content part (block) types that carry a medium other than images, in each API's names.
MEDIA_TYPES = frozenset({"input_audio", "file", "document", "input_file"})


def why_unsupported(kind: str, accepted: str) -> str:
    """Why a content part or block of type ``kind`` is refused: a medium (audio, a file)
    cannot be read by the models served here; any other type is not one this route accepts
    (``accepted`` names those)."""
    if kind in MEDIA_TYPES:
        return "models are served here on text and images, so audio and files cannot be read"
    return f"this server accepts {accepted}"


def shape_for(path: str) -> Shape:
    """The error shape of the route at ``path``."""
    if path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/"):
        return "anthropic"
    if path.startswith(OLLAMA_PREFIX):
        return "ollama"
    return "openai"


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct, kw_only=True):
    error: ErrorDetail


class AnthropicErrorDetail(msgspec.Struct, kw_only=True):
    type: str
    message: str


class AnthropicErrorBody(msgspec.Struct, kw_only=True):
    type: str
    error: AnthropicErrorDetail


class OllamaErrorBody(msgspec.Struct, kw_only=True):
    """Ollama's error: the message alone (also the last line of a stream that failed)."""

    error: str


_encoder = msgspec.json.Encoder()


# The HTTP status of each kind of error the core raises (actors.messages.ErrorKind).
STATUS_OF: dict[ErrorKind, int] = {
    "invalid": 400,
    "unknown_model": 404,
    "conflict": 409,
    "too_large": 413,
    "overloaded": 429,
    "unavailable": 503,
    "internal": 500,
}


def error_type_for(status: int) -> str:
    """OpenAI's ``type`` for an HTTP status (clients branch on the status, people read this)."""
    if status >= 500:
        return "server_error"
    if status == 429:
        return "rate_limit_error"
    if status == 401:
        return "authentication_error"
    return "invalid_request_error"


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    # Anthropic says "overloaded" with 529; a server that is stopping or swamped is that.
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_type_for(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status."""
    if status in _ANTHROPIC_TYPES:
        return _ANTHROPIC_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


class ApiError(Exception):
    """A failure to answer with ``status`` in the route's error shape.

    Raised anywhere below a handler; the error middleware turns it into the response.
    ``type`` is OpenAI's (Anthropic's follows from the status); ``retry_after`` (seconds)
    becomes a Retry-After header; ``headers`` are added as they are; ``close`` closes the
    connection after the answer (what the client was sending cannot be trusted to end).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        headers: dict[str, str] | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or error_type_for(status)
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.headers = dict(headers or {})
        self.close = close

    @classmethod
    def from_admission(cls, err: AdmissionError) -> ApiError:
        """Admission's refusal with the status of its kind: message, param, code, retry."""
        return cls(
            STATUS_OF[err.kind],
            err.message,
            param=err.param,
            code=err.code,
            retry_after=err.retry_after,
        )

    def body(self, shape: Shape = "openai") -> bytes:
        """The JSON error object (also the payload of an SSE error event)."""
        if shape == "anthropic":
            kind = anthropic_type_for(self.status)
            body = AnthropicErrorBody(
                type="error", error=AnthropicErrorDetail(type=kind, message=self.message)
            )
            return _encoder.encode(body)
        if shape == "ollama":
            return _encoder.encode(OllamaErrorBody(error=self.message))
        detail = ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return _encoder.encode(ErrorBody(error=detail))

    def response(self, shape: Shape = "openai") -> web.Response:
        """The complete HTTP response for this error."""
        headers = dict(self.headers)
        if self.retry_after is not None:
            # Retry-After takes whole seconds; rounding up never invites an early retry.
            headers["Retry-After"] = str(max(0, math.ceil(self.retry_after)))
        response = web.Response(
            status=self.status,
            body=self.body(shape),
            content_type="application/json",
            headers=headers,
        )
        if self.close:
            response.force_close()
        return response


def _from_http_exception(request: web.Request, exc: web.HTTPException) -> ApiError:
    """aiohttp's own refusals (no route, wrong method, body too large) in the error shape."""
    # Keep headers the status needs (Allow on 405), drop the ones describing aiohttp's body.
    headers = {
        k: v for k, v in exc.headers.items() if k.lower() not in ("content-type", "content-length")
    }
    if isinstance(exc, web.HTTPNotFound):
        message = f"Invalid URL ({request.method} {request.path})"
    elif isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        message = f"Method {request.method} not allowed for {request.path} (allowed: {allowed})"
    else:
        message = exc.text or exc.reason
    return ApiError(exc.status, message, headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer every failure below it in the route's error shape; the server keeps serving."""
    shape = shape_for(request.path)
    try:
        return await handler(request)
    except ApiError as err:
        return err.response(shape)
    except AdmissionError as err:
        return ApiError.from_admission(err).response(shape)
    except web.HTTPException as exc:
        if exc.status < 400:  # redirects and the like are not failures
            raise
        return _from_http_exception(request, exc).response(shape)
    except Exception:
        log.exception("unexpected error answering %s %s", request.method, request.path)
        error = ApiError(500, "The server had an error while processing your request.")
        return error.response(shape)


async def ask_admission(admission: ActorRef, msg: Message) -> Any:
    """Ask the admission actor; its refusals and the runtime's failures become ApiError."""
    try:
        return await admission.ask(msg, timeout=ADMISSION_TIMEOUT_S)
    except AdmissionError as err:
        raise ApiError.from_admission(err) from err
    except MailboxFull as err:  # ask waits for room, but admission may pass on a full mailbox
        raise ApiError(
            429, "The server is overloaded; retry later.", retry_after=DEFAULT_RETRY_AFTER_S
        ) from err
    except AskTimeout as err:
        raise ApiError(503, "Admission did not answer in time.") from err
    except ActorDead as err:
        raise ApiError(503, "The server is not accepting requests right now.") from err
