"""One record per HTTP request: it feeds the request metrics and the access log line.

The outermost middleware creates the record; generation routes fill it from the request's
event stream (``ObservedEvents``), which is where time to first token and the time between
tokens are measured, as the client sees them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from troupe.actors.messages import RequestEvent, RequestFinished, RequestStarted, TokensGenerated
from troupe.api.metrics import Metrics
from troupe.runtime import ReplyStream

access_log = logging.getLogger("api.access")

# nginx's status for a request whose client closed the connection before the answer.
CLIENT_CLOSED = 499


@dataclass
class RequestRecord:
    """What one request did: filled in as it runs, logged and counted when it ends."""

    metrics: Metrics
    started: float
    request_id: str | None = None
    model: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int = 0
    finish_reason: str | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    # Called with the final status when the request is over (the dashboard's board).
    on_close: list[Callable[[int], None]] = field(default_factory=list)

    def observe(self, event: RequestEvent) -> None:
        """Learn from one event of the request's stream (and time it)."""
        match event:
            case RequestStarted():
                self.prompt_tokens = event.prompt_tokens
                self.cached_tokens = event.cached_tokens
            case TokensGenerated(token_ids=token_ids) if token_ids:
                now = time.perf_counter()
                model = self.model or ""
                if self.last_token_at is None:
                    self.first_token_at = now
                    self.metrics.ttft.labels(model).observe(now - self.started)
                else:
                    gap = (now - self.last_token_at) / len(token_ids)
                    self.metrics.itl.labels(model).observe(gap)
                self.last_token_at = now
                self.completion_tokens += len(token_ids)
            case RequestFinished(usage=usage):
                self.finish_reason = event.finish_reason
                # A request refused before it started has no tokens to count.
                if self.prompt_tokens is not None:
                    self.prompt_tokens = usage.prompt_tokens
                    self.cached_tokens = usage.cached_tokens
                    # The usage counts tokens no delta carries (the end-of-sequence token).
                    self.completion_tokens = usage.completion_tokens

    def close(self, request: web.Request, status: int) -> None:
        """The request is over: count it and write its access log line."""
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        metrics = self.metrics
        metrics.requests.labels(route, request.method, str(status)).inc()
        if self.prompt_tokens is not None:
            model = self.model or ""
            metrics.prompt_tokens.labels(model, route).inc(self.prompt_tokens)
            metrics.cached_tokens.labels(model, route).inc(self.cached_tokens or 0)
            metrics.generated_tokens.labels(model).inc(self.completion_tokens)
        if access_log.isEnabledFor(logging.INFO):
            access_log.info(self.line(request.method, route, status))
        for hook in self.on_close:
            hook(status)

    def line(self, method: str, route: str, status: int) -> str:
        """The access log line: ``key=value`` pairs, ``-`` for what does not apply."""
        now = time.perf_counter()
        ttft = None if self.first_token_at is None else (self.first_token_at - self.started) * 1e3
        generated = self.prompt_tokens is not None
        fields = {
            "request_id": self.request_id,
            "method": method,
            "route": route,
            "model": self.model,
            "status": status,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens if generated else None,
            "cached_tokens": self.cached_tokens,
            "ttft_ms": None if ttft is None else round(ttft, 1),
            "total_ms": round((now - self.started) * 1e3, 1),
            "finish_reason": self.finish_reason,
        }
        return " ".join(f"{key}={_value(value)}" for key, value in fields.items())


def _value(value: object) -> str:
    if value is None:
        return "-"
    text = str(value)
    # Quote what would split the line into more pairs (model names are user input).
    if not text or any(c.isspace() or c in '"=' for c in text):
        return json.dumps(text)
    return text


RECORD = web.RequestKey("record", RequestRecord)


class ObservedEvents:
    """A request's event stream that shows every event to the request's record on the way."""

    def __init__(self, events: ReplyStream[RequestEvent], record: RequestRecord) -> None:
        self.events = events
        self.record = record

    def __aiter__(self) -> ObservedEvents:
        return self

    async def __anext__(self) -> RequestEvent:
        event = await self.events.__anext__()
        self.record.observe(event)
        return event


def telemetry_middleware(metrics: Metrics) -> Middleware:
    """The outermost middleware: a record per request, closed whatever the outcome."""

    @web.middleware
    async def telemetry(request: web.Request, handler: Handler) -> web.StreamResponse:
        record = RequestRecord(metrics=metrics, started=time.perf_counter())
        request[RECORD] = record
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:  # what the error middleware lets through (< 400)
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = CLIENT_CLOSED
            raise
        finally:
            record.close(request, status)

    return telemetry
