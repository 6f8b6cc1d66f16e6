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

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Protocol

from aiohttp import web

from actors.config import ServeConfig
from api.app import create_app
from api.shutdown import ABORT_WAIT_S, INFLIGHT
from runtime import ActorRef, ActorSystem


class ServingActors(Protocol):
    """What the HTTP layer needs of the serving actors (``actors.serving.ServingHandles``)."""

    @property
    def admission(self) -> ActorRef: ...


class HttpServer:
    """A running HTTP server: its ``url``, its aiohttp ``app``, and ``close()``."""

    def __init__(self, runner: web.AppRunner, url: str) -> None:
        self.runner = runner
        self.url = url

    @property
    def app(self) -> web.Application:
        """The aiohttp application being served."""
        return self.runner.app

    def hurry(self) -> None:
        """Cut the shutdown's grace period short (a second signal while closing)."""
        self.app[INFLIGHT].hurry()

    async def close(self) -> None:
        """Stop accepting, let requests in flight finish (up to the grace), end the rest."""
        await self.runner.cleanup()


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def start_http(
    system: ActorSystem, config: ServeConfig, serving: ServingActors
) -> HttpServer:
    """Serve ``create_app`` on ``config.host``/``config.port`` (0: a free port; see ``.url``)."""
    app = create_app(system=system, admission=serving.admission, config=config)
    runner = web.AppRunner(
        app,
        # A client that disconnects cancels its handler, which closes the request's event
        # stream and so frees its batch slot at once.
        handler_cancellation=True,
        # The app drains its requests itself (on_shutdown); this only bounds what is left.
        shutdown_timeout=ABORT_WAIT_S,
        # api.access logs one line per request, with what aiohttp's access log cannot know.
        access_log=None,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    host, port = runner.addresses[0][:2]
    return HttpServer(runner, _url(host, port))


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
