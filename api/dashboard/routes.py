"""The dashboard's routes: the page and its two files (no key: they hold no data) and the
snapshots' stream, ``GET /actors/events``."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
from collections.abc import AsyncIterator

from aiohttp import web

from troupe.api.dashboard.board import board_middleware
from troupe.api.dashboard.hub import INTERVAL_S, EventHub
from troupe.api.sse import EventStream
from troupe.runtime import ActorSystem

# The browser's reconnection delay, sent in the stream (ms).
RETRY_MS = 1000

STATIC = "static"
PAGE = "dashboard.html"
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
# The page and its files: no data, so no key (see the package's docstring).
PUBLIC_PATHS = frozenset({"/", "/dashboard", *(f"/dashboard/{name}" for name in ASSETS)})

HUB = web.AppKey("dashboard_hub", EventHub)


def static_file(name: str) -> bytes:
    """One of the page's files, from the package's data (``api/static``), wherever the
    package is installed: named by this package's parent, never by a top-level ``api``."""
    return (importlib.resources.files("troupe.api") / STATIC / name).read_bytes()


# The page loads only its own files and talks only to this server.
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


class DashboardRoutes:
    """The dashboard's routes, its request board and its event hub, for one application."""

    def __init__(self, system: ActorSystem, *, interval: float = INTERVAL_S) -> None:
        self.hub = EventHub(system, interval=interval)

    def register(self, app: web.Application) -> None:
        """Add the routes, the board's middleware and the hub's lifetime to ``app``.

        Register before ``IntrospectionRoutes``: ``/actors/events`` must come before
        ``/actors/{name}``.
        """
        app[HUB] = self.hub
        app.router.add_get("/actors/events", self.events)
        app.router.add_get("/", self.root)
        app.router.add_get("/dashboard", self.page)
        for name in ASSETS:
            app.router.add_get(f"/dashboard/{name}", self.asset)
        # Innermost: only requests that passed the key reach the board.
        app.middlewares.append(board_middleware(self.hub.board))
        app.cleanup_ctx.append(self._lifetime)
        app.on_shutdown.append(self._shutdown)

    async def _lifetime(self, app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(self.hub.run(), name="dashboard-hub")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _shutdown(self, app: web.Application) -> None:
        # Open streams would otherwise hold the shutdown for aiohttp's whole timeout.
        self.hub.close()

    async def root(self, request: web.Request) -> web.Response:
        """``GET /``: to the dashboard."""
        raise web.HTTPFound("/dashboard")

    async def page(self, request: web.Request) -> web.Response:
        """``GET /dashboard``: the page."""
        return web.Response(body=static_file(PAGE), content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-cache",
                                     "Content-Security-Policy": _CSP})

    async def asset(self, request: web.Request) -> web.Response:
        """``GET /dashboard/<file>``: the page's script and stylesheet."""
        name = request.path.rpartition("/")[2]
        return web.Response(body=static_file(name), content_type=ASSETS[name], charset="utf-8",
                            headers={"Cache-Control": "no-cache"})

    async def events(self, request: web.Request) -> web.StreamResponse:
        """``GET /actors/events``: the snapshots as SSE (``event: snapshot``), until the
        client leaves or the server shuts down."""
        stream = await EventStream.open(request)
        subscriber = self.hub.subscribe()
        try:
            # Sent at once: the client knows it is connected, and how soon to reconnect.
            await stream.response.write(f"retry: {RETRY_MS}\n\n".encode())
            while (data := await subscriber.next()) is not None:
                await stream.send([("snapshot", data)])
            await stream.close()
        except ConnectionResetError:
            pass  # the viewer has gone
        finally:
            self.hub.unsubscribe(subscriber)
        return stream.response
