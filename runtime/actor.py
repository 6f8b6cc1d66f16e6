"""The base class users subclass: lifecycle hooks and one message at a time."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from troupe.runtime.cell import ActorCell
    from troupe.runtime.ref import ActorRef
    from troupe.runtime.reply import Reply
    from troupe.runtime.system import ActorSystem


class Actor:
    """Subclass and override ``handle``; the runtime calls it for one message at a time.

    ``__init__`` receives the keyword arguments given to ``spawn`` beyond the runtime's own.
    From ``on_start`` on, ``self.ref``, ``self.system`` and ``self.name`` are set. A
    thread-pinned actor's ``__init__``, ``on_start``, ``handle`` and ``on_stop`` all run on
    its thread.
    """

    ref: ActorRef
    system: ActorSystem
    name: str
    _cell: ActorCell

    async def on_start(self) -> None:
        """Called before the first message; an error here fails ``spawn`` (or the restart)."""

    async def handle(self, msg: Any) -> Any:
        """Handle one message. The return value answers ``ask`` (and a ``stream`` that did
        not take its reply); an exception goes to the asker, or to the supervisor for ``tell``.
        """
        raise NotImplementedError(f"{type(self).__qualname__} does not handle messages")

    async def on_stop(self, error: BaseException | None) -> None:
        """Called once when this instance ends: error is None for a clean stop, else the error
        that caused a restart or failure. Replies still open afterwards fail with ActorDead.
        """

    def report(self) -> dict[str, Any] | None:
        """Plain JSON-able values for introspection, or None.

        Runs on the system's event loop thread, possibly while ``handle`` runs on a pinned
        thread: read plain attributes, touch no thread-bound state (no MLX).
        """
        return None

    def take_reply(self) -> Reply:
        """The ``Reply`` of the message being handled, which must have come with ``stream()``.

        Once taken, the reply is the actor's to send on and close, from its own thread, also
        after ``handle`` returned; the runtime fails it with ``ActorDead`` if the actor ends
        while it is still open.
        """
        return self._cell.take_reply()

    def take_answer(self) -> Reply:
        """The answer of the message being handled, which must have come with ``ask``.

        Once taken, the actor gives it later (``send`` answers, ``fail`` raises in the asker),
        from any thread, so that a handler can start a long job, return, and take the next
        message meanwhile; the runtime no longer answers with ``handle``'s return value and
        fails the answer with ``ActorDead`` if the actor ends before giving it.
        """
        return self._cell.take_answer()
