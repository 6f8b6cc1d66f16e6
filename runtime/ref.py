"""ActorRef: the handle everything else uses to reach an actor, from any thread."""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any

import msgspec

from troupe.runtime.messages import Envelope
from troupe.runtime.reply import ReplyStream, open_reply
from troupe.runtime.snapshot import ENDED
from troupe.runtime.threads import call_on, run_on

if TYPE_CHECKING:
    from troupe.runtime.cell import ActorCell


def _check(msg: object) -> None:
    if not isinstance(msg, msgspec.Struct):
        raise TypeError(f"messages must be msgspec.Struct instances, not {type(msg).__name__}")


class ActorRef:
    """Address of one actor. Stays valid across restarts; after the actor stops, sending to
    it raises ``ActorDead``.

    Every method works from any thread: mailboxes live on the system's event loop, and calls
    from elsewhere (a pinned actor's thread) hop there.
    """

    __slots__ = ("_cell", "name")

    def __init__(self, cell: ActorCell) -> None:
        self._cell = cell
        self.name = cell.name

    def __repr__(self) -> str:
        return f"ActorRef({self.name!r})"

    @property
    def alive(self) -> bool:
        """False once the actor has stopped or failed."""
        return self._cell.state not in ENDED

    async def tell(self, msg: msgspec.Struct) -> None:
        """Send without waiting for an answer; waits while the mailbox is full."""
        _check(msg)
        await self._put(Envelope(msg, None))

    def try_tell(self, msg: msgspec.Struct) -> None:
        """Send at once or raise ``MailboxFull``: for admission control, never waits for room."""
        _check(msg)
        self._put_nowait(Envelope(msg, None))

    async def ask(self, msg: msgspec.Struct, timeout: float | None = None) -> Any:
        """Send and wait for ``handle``'s return value (or its exception, re-raised here).

        Raises ``AskTimeout`` after ``timeout`` seconds (waiting for room included) and
        ``ActorDead`` if the actor ends before answering.
        """
        _check(msg)
        cell = self._cell
        if asyncio.get_running_loop() is cell.loop:
            return await cell.ask(msg, timeout)
        return await run_on(cell.loop, cell.ask(msg, timeout))

    async def stream(self, msg: msgspec.Struct) -> ReplyStream[Any]:
        """Send and get a ``ReplyStream`` of the items the actor sends; waits for room."""
        _check(msg)
        reply, stream = open_reply()
        await self._put(Envelope(msg, reply))
        return stream

    def try_stream(self, msg: msgspec.Struct) -> ReplyStream[Any]:
        """Like ``stream`` but raises ``MailboxFull`` at once when the mailbox is full."""
        _check(msg)
        reply, stream = open_reply()
        self._put_nowait(Envelope(msg, reply))
        return stream

    async def _put(self, envelope: Envelope) -> None:
        cell = self._cell
        if asyncio.get_running_loop() is cell.loop:
            await cell.mailbox.put(envelope)
        else:
            await run_on(cell.loop, cell.mailbox.put(envelope))

    def _put_nowait(self, envelope: Envelope) -> None:
        cell = self._cell
        if threading.get_ident() == cell.loop_thread:
            cell.mailbox.put_nowait(envelope)
        else:
            call_on(cell.loop, cell.mailbox.put_nowait, envelope)
