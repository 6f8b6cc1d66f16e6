"""Streamed replies: one request, many items, from any thread to any event loop."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class _Channel:
    """State shared by the two ends. Guarded by ``lock``: the ends may live on different threads."""

    __slots__ = ("lock", "items", "closed", "error", "gone", "waiter", "waiter_thread")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: deque[Any] = deque()
        self.closed = False
        self.error: BaseException | None = None
        self.gone = False
        self.waiter: asyncio.Future[None] | None = None
        self.waiter_thread = 0


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _wake(waiter: asyncio.Future[None], thread: int) -> None:
    """Wake a consumer waiting on ``waiter``, which belongs to the loop running on ``thread``."""
    if thread == threading.get_ident():
        _resolve(waiter)
        return
    try:
        waiter.get_loop().call_soon_threadsafe(_resolve, waiter)
    except RuntimeError:
        # The consumer's event loop is closed: there is nobody left to wake.
        pass


class Reply:
    """The producing end of a streamed reply, held by the actor (see ``Actor.take_reply``).

    Every method is thread-safe and never blocks, so a thread-pinned actor may keep the reply
    and send from its own thread long after ``handle`` returned.
    """

    __slots__ = ("_ch", "_on_finish")

    def __init__(self, channel: _Channel) -> None:
        self._ch = channel
        # Set while an actor holds the reply, so the runtime can fail it if the actor dies.
        self._on_finish: Callable[[Reply], None] | None = None

    def send(self, item: Any) -> bool:
        """Queue one item for the consumer; False (and dropped) once the consumer has gone."""
        ch = self._ch
        with ch.lock:
            if ch.gone or ch.closed:
                return False
            ch.items.append(item)
            waiter, ch.waiter = ch.waiter, None
            thread = ch.waiter_thread
        if waiter is not None:
            _wake(waiter, thread)
        return True

    def close(self) -> None:
        """End the stream: the consumer's iteration stops after the items already sent."""
        self._finish(None)

    def fail(self, error: BaseException) -> None:
        """End the stream with an error: the consumer gets the items sent, then ``error``."""
        self._finish(error)

    @property
    def consumer_gone(self) -> bool:
        """True once the consumer closed or dropped its ``ReplyStream``."""
        return self._ch.gone

    @property
    def done(self) -> bool:
        """True once the stream was closed or failed."""
        return self._ch.closed

    def _finish(self, error: BaseException | None) -> None:
        ch = self._ch
        with ch.lock:
            if ch.closed:
                return
            ch.closed = True
            ch.error = error
            waiter, ch.waiter = ch.waiter, None
            thread = ch.waiter_thread
        if waiter is not None:
            _wake(waiter, thread)
        on_finish, self._on_finish = self._on_finish, None
        if on_finish is not None:
            on_finish(self)


class AskReply(Reply):
    """The answer to an ``ask``, taken by the actor to give after ``handle`` returned (see
    ``ActorCell.take_answer``), so that the actor can handle its next message meanwhile.

    The first ``send`` answers the asker; ``close`` without one answers None; ``fail`` makes
    the ask raise. Every call after the first is ignored (``send`` returns False). Like
    ``Reply``, every method is thread-safe and never blocks.
    """

    __slots__ = ("_future", "_lock", "_closed")

    def __init__(self, future: asyncio.Future[Any]) -> None:
        # Not Reply.__init__: there is no channel, only the asker's future.
        self._future = future
        self._lock = threading.Lock()
        self._closed = False
        self._on_finish = None

    def send(self, item: Any) -> bool:
        """Answer the ask with ``item``; False if it was answered already."""
        return self._answer(item, None)

    def close(self) -> None:
        """Answer None, unless the ask was answered already."""
        self._answer(None, None)

    def fail(self, error: BaseException) -> None:
        """Make the ask raise ``error``, unless it was answered already."""
        self._answer(None, error)

    @property
    def consumer_gone(self) -> bool:
        """True once the asker stopped waiting (it timed out or was cancelled)."""
        return self._future.done() and not self._closed

    @property
    def done(self) -> bool:
        """True once the ask was answered (or failed)."""
        return self._closed

    def _answer(self, result: Any, error: BaseException | None) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._closed = True
        # No longer open before the asker can see its answer.
        on_finish, self._on_finish = self._on_finish, None
        if on_finish is not None:
            on_finish(self)
        _settle_future(self._future, result, error)
        return True


def _settle_future(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    """Complete ``future`` from any thread; a future already done (the asker left) stays so."""

    def apply() -> None:
        if future.done():
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    loop = future.get_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        apply()
        return
    try:
        loop.call_soon_threadsafe(apply)
    except RuntimeError:
        # The asker's event loop is closed: nobody is left to answer.
        pass


class ReplyStream(Generic[T]):
    """The consuming end of a streamed reply: ``async for item in stream``.

    Iteration ends when the actor closes the reply and raises the actor's error if it failed
    (``ActorDead`` if the actor died holding it). ``aclose()``, leaving ``async with``, or
    dropping the stream tells the actor the consumer has gone. The stream binds to an event
    loop only when it first waits, so it may be created on one thread and read on another.
    """

    __slots__ = ("_ch",)

    def __init__(self, channel: _Channel) -> None:
        self._ch = channel

    def __aiter__(self) -> ReplyStream[T]:
        return self

    async def __anext__(self) -> T:
        ch = self._ch
        while True:
            with ch.lock:
                if ch.items:
                    return ch.items.popleft()
                if ch.error is not None:
                    raise ch.error
                if ch.closed or ch.gone:
                    raise StopAsyncIteration
                waiter = asyncio.get_running_loop().create_future()
                ch.waiter = waiter
                ch.waiter_thread = threading.get_ident()
            await waiter

    async def next(self) -> T:
        """The next item; raises ``StopAsyncIteration`` once the stream has ended."""
        return await self.__anext__()

    async def aclose(self) -> None:
        """Leave the stream: items still queued are dropped and ``Reply.send`` returns False."""
        self._leave()

    async def __aenter__(self) -> ReplyStream[T]:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._leave()

    def __del__(self) -> None:
        # A consumer that drops the stream (e.g. an HTTP handler cancelled on disconnect) has
        # gone too; the producer learns it from send() and consumer_gone. No lock: flag and
        # deque.clear are atomic, and taking a lock in a finalizer risks a self-deadlock.
        self._ch.gone = True
        self._ch.items.clear()

    def _leave(self) -> None:
        ch = self._ch
        with ch.lock:
            ch.gone = True
            ch.items.clear()


def open_reply() -> tuple[Reply, ReplyStream[Any]]:
    """A connected (producer, consumer) pair."""
    channel = _Channel()
    return Reply(channel), ReplyStream(channel)
