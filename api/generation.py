"""Answering a generation request from its event stream: whole, or streamed as SSE.

OpenAI's routes and Anthropic's share this; each brings a ``Renderer`` for its shapes. The
rules are the same for both: a request refused before it started gets a plain error response
with its status (no header has been sent yet); a failure after that ends the stream with the
API's error event; the client going away closes the event stream, which tells the scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import ABC, abstractmethod

from aiohttp import web

from troupe.actors.messages import (
    AdmissionTicket,
    RequestEvent,
    RequestFinished,
    TokensGenerated,
    Usage,
)
from troupe.api.errors import DEFAULT_RETRY_AFTER_S, STATUS_OF, ApiError
from troupe.api.shutdown import INFLIGHT, SHUTTING_DOWN
from troupe.api.sse import EventStream, Frame
from troupe.api.telemetry import RECORD, ObservedEvents, RequestRecord

log = logging.getLogger(__name__)

_ENDED_EARLY = "The request ended without a result."


class Renderer(ABC):
    """Turns one request's events into one API's response bytes."""

    # Streamed as newline-delimited JSON (Ollama's) instead of server-sent events.
    ndjson = False

    @abstractmethod
    def opening(self, first: RequestEvent) -> list[Frame]:
        """Events sent right after the SSE headers (``first`` is the request's first event)."""

    @abstractmethod
    def delta(self, event: TokensGenerated) -> list[Frame]:
        """Events for one delta (none when it carries nothing to send)."""

    @abstractmethod
    def closing(self, finished: RequestFinished) -> list[Frame]:
        """The last events of a stream that ended normally."""

    @abstractmethod
    def failure(self, error: ApiError) -> list[Frame]:
        """The last events of a stream that failed after its headers were sent."""

    @abstractmethod
    def whole(self, deltas: list[TokensGenerated], finished: RequestFinished) -> bytes:
        """The non-streaming response body."""

    def interrupted(self, error: ApiError, usage: Usage) -> list[Frame]:
        """The last events of a stream cut short after its headers were sent (a failure, the
        shutdown), ``usage`` counting the tokens so far: by default, ``failure``'s."""
        return self.failure(error)


def failure_of(finished: RequestFinished) -> ApiError | None:
    """The error a finished request carries, or None when it ended normally."""
    if finished.error is None and finished.finish_reason not in ("error", "abort"):
        return None
    status = STATUS_OF[finished.error_kind or "internal"]
    message = finished.error or f"The request ended with finish_reason '{finished.finish_reason}'."
    # 429 (a full queue) and 503 (memory short, a model being unloaded) pass with time.
    retry_after = finished.retry_after
    if retry_after is None and status in (429, 503):
        retry_after = DEFAULT_RETRY_AFTER_S
    return ApiError(status, message, retry_after=retry_after)


def usage_so_far(record: RequestRecord) -> Usage:
    """The tokens a request has used until now, as its record counted them."""
    return Usage(
        prompt_tokens=record.prompt_tokens or 0,
        completion_tokens=record.completion_tokens,
        cached_tokens=record.cached_tokens or 0,
    )


def _as_api_error(exc: Exception) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    log.error("request failed while streaming", exc_info=exc)
    return ApiError(500, "The server had an error while processing your request.")


async def answer(
    request: web.Request, ticket: AdmissionTicket, renderer: Renderer, *, stream: bool
) -> web.StreamResponse:
    """Answer an admitted request, whole or as a stream, and close its event stream."""
    record = request[RECORD]
    record.model = ticket.admitted.model
    events = ObservedEvents(ticket.events, record)
    try:
        if stream:
            return await _answer_stream(request, events, renderer)
        return await _answer_whole(events, renderer)
    finally:
        # On every path, including the client going away: closing an unfinished stream tells
        # the scheduler to drop the request; closing a finished one costs nothing.
        await ticket.events.aclose()


async def _answer_whole(events: ObservedEvents, renderer: Renderer) -> web.Response:
    """Collect every event, then answer once (an error status if the request failed)."""
    deltas: list[TokensGenerated] = []
    async for event in events:
        if isinstance(event, TokensGenerated):
            deltas.append(event)
        elif isinstance(event, RequestFinished):
            if failure := failure_of(event):
                raise failure
            return web.Response(body=renderer.whole(deltas, event), content_type="application/json")
    raise ApiError(500, _ENDED_EARLY)


async def _answer_stream(
    request: web.Request, events: ObservedEvents, renderer: Renderer
) -> web.StreamResponse:
    """Stream events once the request has started; a refusal before that is a plain error."""
    first = await anext(events, None)
    if first is None:
        raise ApiError(500, _ENDED_EARLY)
    if isinstance(first, RequestFinished) and (failure := failure_of(first)):
        raise failure  # refused before it started (a full queue): no header was sent yet
    stream = await EventStream.open(request, renderer.ndjson)
    try:
        await stream.send(renderer.opening(first))
        event = first
        while not isinstance(event, RequestFinished):
            if isinstance(event, TokensGenerated):
                await stream.send(renderer.delta(event))
            event = await anext(events, None)
            if event is None:
                raise ApiError(500, _ENDED_EARLY)
        failure = failure_of(event)
        if failure:
            await stream.send(renderer.interrupted(failure, event.usage))
        else:
            await stream.send(renderer.closing(event))
        await stream.close()
    except ConnectionResetError:
        log.info("client went away during %s", request[RECORD].request_id)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is None or not request.app[INFLIGHT].aborted(task):
            raise  # the client went away (aiohttp cancels its handler): nobody to tell
        # The shutdown's grace period is over: end the stream cleanly, as the API ends one.
        task.uncancel()
        request[RECORD].finish_reason = "abort"
        await _end_with(stream, renderer, ApiError(503, SHUTTING_DOWN), request[RECORD])
    except Exception as exc:  # headers are out: the failure goes in the stream
        await _end_with(stream, renderer, _as_api_error(exc), request[RECORD])
    return stream.response


async def _end_with(
    stream: EventStream, renderer: Renderer, error: ApiError, record: RequestRecord
) -> None:
    with contextlib.suppress(ConnectionResetError):
        await stream.send(renderer.interrupted(error, usage_so_far(record)))
        await stream.close()
