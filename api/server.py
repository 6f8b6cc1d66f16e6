"""Run the HTTP application on an actor system that is already running: the embedding API.

``troupe serve`` uses exactly this; a Python program that starts the serving actors itself
(``actors.serving.start_serving``) and spawns its own actors next to them uses it too::

    async with ActorSystem() as system:
        handles = await start_serving(system, config)
        async with serve_http(system, config, handles) as server:
            print(server.url)
            ...

Leaving the block (or ``await server.close()``) stops accepting connections, gives the
requests in flight ``config.shutdown_grace`` seconds, ends the rest cleanly, then closes.
The actor system is left running: its owner stops it (``ActorSystem``'s orderly stop, where
actors flush what they hold).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import re
import resource
import time
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol

from aiohttp import web
from aiohttp.http import RawRequestMessage
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from troupe.actors.config import ServeConfig, api_keys
from troupe.api.app import create_app
from troupe.api.errors import ApiError, shape_for
from troupe.api.shutdown import ABORT_WAIT_S, INFLIGHT
from troupe.runtime import ActorRef, ActorSystem

log = logging.getLogger(__name__)

# A flood (refused connections, failed accept() calls) is logged once per this many seconds.
LOG_INTERVAL_S = 10.0
# How long a refused connection is kept to read what its client sends, so that closing it
# does not reset the connection before the client has read the 503.
REFUSE_LINGER_S = 1.0


class ServingActors(Protocol):
    """What the HTTP layer needs of the serving actors (``actors.serving.ServingHandles``)."""

    @property
    def admission(self) -> ActorRef: ...


class _Throttled:
    """A warning for an event that may repeat thousands of times a second: the first time,
    then at most once per ``LOG_INTERVAL_S``, with how many times it happened meanwhile."""

    def __init__(self, message: str) -> None:
        self.message = message
        self.count = 0
        self.last = -math.inf

    def __call__(self, detail: object) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= LOG_INTERVAL_S:
            log.warning("%s: %s (%d time(s) since the last report)", self.message, detail,
                        self.count)
            self.count, self.last = 0, now


# --- below the application: aiohttp's connections ------------------------------------------

# llhttp's reasons are fixed phrases ("Invalid character in chunk size"); what follows them
# quotes the request. A reason with anything but words is left out.
_REASON = re.compile(r"[A-Za-z][A-Za-z ,-]{0,79}")


def protocol_error(status: int, exc: BaseException | None) -> ApiError:
    """What aiohttp's protocol refuses (a request it cannot parse, a handler that failed
    outside the application) as an ApiError whose message quotes nothing of the request."""
    if isinstance(exc, LineTooLong):
        return ApiError(431, "A request header or the request line is too long.")
    if status >= 500:
        return ApiError(status, "The server had an error while processing your request.")
    message = "The request is not valid HTTP"
    if isinstance(exc, HttpProcessingError):
        reason = exc.message.split(":", 1)[0].strip()
        if _REASON.fullmatch(reason):
            message += f" ({reason})"
    return ApiError(status, message + ".")


class _ApiRequestHandler(RequestHandler):
    """aiohttp's HTTP/1.1 protocol, answering its own refusals in the API's error shape."""

    def data_received(self, data: bytes) -> None:
        """Parse what arrived; a body whose framing breaks fails its reader at once."""
        request = self._current_request
        super().data_received(data)
        # aiohttp's C parser drops the body of a request whose chunks or length break after
        # its head went up (its Python parser fails the body): the handler would wait on it
        # until the body timeout. Fail it now, as the Python parser does.
        if (
            request is not None
            and not request.content.is_eof()
            and self._messages
            and not isinstance(self._messages[-1][0], RawRequestMessage)
        ):
            request.content.set_exception(RequestPayloadError("malformed request body"))

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """A request aiohttp could not parse, or a failure outside the application: JSON in
        the route's error shape (Anthropic's under /v1/messages when the path is known),
        never an echo of the input (aiohttp's own answer quotes the bad bytes)."""
        if status >= 500:
            log.error("error outside the application answering %s", request.path, exc_info=exc)
        else:
            # Debug only, and no message (it quotes the request, a key perhaps): any client
            # can send these as fast as it likes.
            log.debug("malformed request from %s: %s", request.remote, type(exc).__name__)
        if request.writer.output_size > 0:  # what aiohttp does: the answer is already out
            raise ConnectionError("the response was sent already; cannot send the error")
        response = protocol_error(status, exc).response(shape_for(request.path))
        response.force_close()
        return response


def _overloaded() -> bytes:
    body = ApiError(503, "The server has too many connections open; retry later.").body()
    return (
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nRetry-After: 1\r\nConnection: close\r\n\r\n%s"
        % (len(body), body)
    )


_OVERLOADED = _overloaded()


class _Refused(asyncio.Protocol):
    """A connection over the cap: a canned 503, then closed. It never reaches aiohttp."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(_OVERLOADED)
        if transport.can_write_eof():
            transport.write_eof()
        # Closing at once could reset the connection (unread request bytes) before the
        # client reads the 503: close when it does, or after a short while.
        self.timer = asyncio.get_running_loop().call_later(REFUSE_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass  # the request is not read

    def eof_received(self) -> bool:
        self.transport.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.timer.cancel()


class _ApiServer(web.Server):
    """aiohttp's low-level server (the application's handler and request factory) with the
    API's error shape below the application and a cap on the connections open at once."""

    def __init__(
        self, inner: web.Server, *, max_connections: int | None, handler_args: dict[str, Any]
    ) -> None:
        super().__init__(
            inner.request_handler,
            request_factory=inner.request_factory,
            handler_cancellation=inner.handler_cancellation,
        )
        self.max_connections = max_connections
        self.handler_args = handler_args
        self.loop = asyncio.get_running_loop()
        # Protocols made but not yet connected: accept() can hand out several at once.
        self.opening: weakref.WeakSet[RequestHandler] = weakref.WeakSet()
        self.refused = _Throttled("refusing connections: too many open")

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        self.opening.discard(handler)
        super().connection_made(handler, transport)

    def __call__(self) -> RequestHandler:
        """The protocol of a connection just accepted (the event loop's protocol factory)."""
        count = len(self.connections) + len(self.opening)
        if self.max_connections is not None and count >= self.max_connections:
            self.refused(f"{count} open, the most is {self.max_connections}")
            return _Refused()  # type: ignore[return-value]  # a protocol all the same
        handler = _ApiRequestHandler(self, loop=self.loop, **self.handler_args)
        self.opening.add(handler)
        return handler


def _open_file_limit() -> int | None:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def max_connections(config: ServeConfig) -> int | None:
    """``config.max_connections``, else three quarters of the open-file limit (None: no
    limit): the rest is for the server's own files (models, cache blocks), so accept() does
    not run out of descriptors."""
    files = _open_file_limit()
    if config.max_connections is not None:
        if files is not None and config.max_connections >= files:
            log.warning("max_connections %d is not below the open-file limit (%d): accept() "
                        "may run out of descriptors", config.max_connections, files)
        return config.max_connections
    return None if files is None else max(1, files * 3 // 4)


class _ApiRunner(web.AppRunner):
    """``web.AppRunner`` whose server is an ``_ApiServer`` built from ``config``."""

    def __init__(self, app: web.Application, config: ServeConfig, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.config = config

    # aiohttp's private hook, and its only one for a RequestHandler of our own (the JSON
    # error on malformed HTTP, the connection cap); tests/test_api_hardening.py pins it.
    async def _make_server(self) -> web.Server:
        inner = await super()._make_server()  # the application started, its handler
        config = self.config
        handler_args = {
            # api.access logs one line per request, with what aiohttp's access log cannot know.
            "access_log": None,
            # aiohttp's keep-alive timer runs while a connection waits for a complete request
            # head: from its opening, and again after each response.
            "keepalive_timeout": config.idle_timeout,
            "max_line_size": config.max_header_bytes,
            "max_field_size": config.max_header_bytes,
        }
        return _ApiServer(inner, max_connections=max_connections(config),
                          handler_args=handler_args)


_ACCEPT_FAILED = "socket.accept() out of system resource"


class _AcceptFloodLog:
    """The loop's exception handler while servers run: accept() failing for want of file
    descriptors is logged without a traceback, once per interval (asyncio logs each failure
    with one); everything else goes to the handler installed before."""

    def __init__(self, previous: Callable[..., object] | None) -> None:
        self.previous = previous
        self.servers = 0
        self.failed = _Throttled("accept() failed")

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") == _ACCEPT_FAILED:
            self.failed(context.get("exception"))
        elif self.previous is not None:
            self.previous(loop, context)
        else:
            loop.default_exception_handler(context)

    @classmethod
    def install(cls, loop: asyncio.AbstractEventLoop) -> _AcceptFloodLog:
        """The handler of ``loop``, installed by the first server and shared by the others."""
        handler = loop.get_exception_handler()
        if not isinstance(handler, cls):
            handler = cls(handler)
            loop.set_exception_handler(handler)
        handler.servers += 1
        return handler

    def release(self, loop: asyncio.AbstractEventLoop) -> None:
        """A server closed: the last one puts the handler before back."""
        self.servers -= 1
        if self.servers == 0 and loop.get_exception_handler() is self:
            loop.set_exception_handler(self.previous)


def exposed_without_key(config: ServeConfig) -> bool:
    """True when the server would listen beyond this machine with no API key."""
    if api_keys(config):
        return False
    if config.host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(config.host).is_loopback
    except ValueError:  # a host name ("" and "0.0.0.0" included) may be any interface
        return True


class HttpServer:
    """A running HTTP server: its ``url``, its aiohttp ``app``, and ``close()``."""

    def __init__(self, runner: web.AppRunner, url: str) -> None:
        self.runner = runner
        self.url = url
        self._flood_log: _AcceptFloodLog | None = None

    @property
    def app(self) -> web.Application:
        """The aiohttp application being served."""
        return self.runner.app

    def hurry(self) -> None:
        """Cut the shutdown's grace period short (a second signal while closing)."""
        self.app[INFLIGHT].hurry()

    async def close(self) -> None:
        """Stop accepting, let requests in flight finish (up to the grace), end the rest."""
        try:
            await self.runner.cleanup()
        finally:
            if self._flood_log is not None:
                self._flood_log.release(asyncio.get_running_loop())
                self._flood_log = None


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def start_http(
    system: ActorSystem, config: ServeConfig, serving: ServingActors
) -> HttpServer:
    """Serve ``create_app`` on ``config.host``/``config.port`` (0: a free port; see ``.url``).

    Beyond the application: connections wait at most ``config.idle_timeout`` for a request
    head, at most ``config.max_connections`` are open at once (more get a 503 and are closed),
    and what aiohttp refuses before the application (a malformed request) is answered in the
    API's error shape.
    """
    if exposed_without_key(config):
        log.warning(
            "listening on %r without an API key: anyone who can reach it can generate and "
            "read /actors and /metrics; set --api-key (or TROUPE_API_KEY)", config.host
        )
    keys = len(api_keys(config))
    if keys > 1 and not config.admin_api_key and not config.shared_cache:
        log.warning(
            "%d API keys and no admin key: every key can read /actors, /metrics and the "
            "dashboard, which show how many tokens of each request's prompt were cached; set "
            "--admin-api-key to keep them to operators", keys
        )
    app = create_app(system=system, admission=serving.admission, config=config)
    runner = _ApiRunner(
        app,
        config,
        # A client that disconnects cancels its handler, which closes the request's event
        # stream and so frees its batch slot at once.
        handler_cancellation=True,
        # The app drains its requests itself (on_shutdown); this only bounds what is left.
        shutdown_timeout=ABORT_WAIT_S,
    )
    await runner.setup()
    server = HttpServer(runner, "")
    try:
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        server._flood_log = _AcceptFloodLog.install(asyncio.get_running_loop())
    except BaseException:
        await runner.cleanup()
        raise
    host, port = runner.addresses[0][:2]
    server.url = _url(host, port)
    return server


@asynccontextmanager
async def serve_http(
    system: ActorSystem, config: ServeConfig, serving: ServingActors
) -> AsyncIterator[HttpServer]:
    """``start_http`` as a context manager: the server closes (gracefully) on leaving."""
    server = await start_http(system, config, serving)
    try:
        yield server
    finally:
        await server.close()
