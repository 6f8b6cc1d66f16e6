"""Graceful shutdown: generation requests in flight get a grace period, then a clean end.

aiohttp's own shutdown cancels what is left after its timeout, which cuts a stream wherever it
is. Instead, once the grace period is over, each request still running is cancelled with a
mark saying why; its handler catches that and ends the stream the API's way (an error event,
then ``[DONE]`` for OpenAI), or answers 503 when no header was sent yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

from aiohttp import web

from troupe.api.errors import ApiError

log = logging.getLogger(__name__)

SHUTTING_DOWN = "The server is shutting down."
# How long aborted requests get to write their last event before aiohttp closes them.
ABORT_WAIT_S = 5.0

H = TypeVar("H", bound=Callable[..., Awaitable[web.StreamResponse]])


class Inflight:
    """The generation requests an application is answering, for a graceful shutdown."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[object]] = set()
        self._aborted: set[asyncio.Task[object]] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._hurry = asyncio.Event()
        self.draining = False
        # Set with ``draining``: what waits on a client (a body still arriving) gives up on it.
        self.stopping = asyncio.Event()

    def __len__(self) -> int:
        return len(self._tasks)

    def aborted(self, task: asyncio.Task[object] | None) -> bool:
        """True when ``task`` was cancelled by the shutdown (not by its client going away)."""
        return task in self._aborted

    def hurry(self) -> None:
        """Cut the grace period short (a second SIGINT/SIGTERM)."""
        self._hurry.set()

    async def shutdown(self, grace: float) -> None:
        """Refuse new requests, wait up to ``grace`` seconds for those running, abort the rest."""
        self.draining = True
        self.stopping.set()
        if self._tasks:
            log.info("waiting up to %.1fs for %d request(s) in flight", grace, len(self._tasks))
            waits = {asyncio.ensure_future(self._idle.wait()),
                     asyncio.ensure_future(self._hurry.wait())}
            await asyncio.wait(waits, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
            for wait in waits:
                wait.cancel()
        left = set(self._tasks)
        if not left:
            return
        log.warning("aborting %d request(s) still running after the grace period", len(left))
        self._aborted |= left
        for task in left:
            task.cancel(SHUTTING_DOWN)
        await asyncio.wait(left, timeout=ABORT_WAIT_S)

    @contextlib.contextmanager
    def track(self) -> Iterator[asyncio.Task[object]]:
        """Count the current task as a request in flight while the block runs; yields it."""
        task = asyncio.current_task()
        assert task is not None  # handlers always run in a task
        self._tasks.add(task)
        self._idle.clear()
        try:
            yield task
        finally:
            self._tasks.discard(task)
            self._aborted.discard(task)
            if not self._tasks:
                self._idle.set()


INFLIGHT = web.AppKey("inflight", Inflight)


def generation(handler: H) -> H:
    """Decorate a route that generates: counted for the shutdown, refused (503) once it began.

    A shutdown abort that lands before the response was started becomes a 503; one that
    lands while streaming is handled by the stream itself (see ``api.generation``).
    """

    @functools.wraps(handler)
    async def guarded(self: object, request: web.Request) -> web.StreamResponse:
        inflight = request.app[INFLIGHT]
        if inflight.draining:
            raise ApiError(503, SHUTTING_DOWN)
        with inflight.track() as task:
            try:
                return await handler(self, request)
            except asyncio.CancelledError:
                if not inflight.aborted(task):
                    raise
                task.uncancel()
                raise ApiError(503, SHUTTING_DOWN) from None

    return guarded  # type: ignore[return-value]
