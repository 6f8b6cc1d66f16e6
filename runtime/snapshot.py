"""Introspection: what one actor looks like right now, as plain JSON-encodable data."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

ActorState = Literal["starting", "running", "restarting", "stopped", "failed"]
ENDED: tuple[ActorState, ...] = ("stopped", "failed")


class ErrorInfo(msgspec.Struct, frozen=True):
    """An exception, reduced to its type name and message."""

    type: str
    message: str

    @classmethod
    def of(cls, error: BaseException) -> ErrorInfo:
        """Describe ``error``."""
        return cls(type=type(error).__qualname__, message=str(error))


class ActorSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """One actor at one moment (``ActorSystem.snapshot()``).

    ``last_error`` is the last error that reached the supervisor (a failed ``tell``, a failed
    restart); errors answered to an asker are the asker's. ``report`` is the actor's own
    ``report()``, or None when it has none or has ended.
    """

    name: str
    actor_class: str
    state: ActorState
    thread: str | None
    group: str | None
    restart: str
    mailbox_depth: int
    mailbox_capacity: int
    waiting_senders: int
    messages_handled: int
    restarts: int
    last_error: ErrorInfo | None
    report: dict[str, Any] | None
