"""The runtime's own exceptions: what a sender sees when a message cannot be handled."""

from __future__ import annotations


class MailboxFull(Exception):
    """The actor's mailbox is at capacity (raised by ``try_tell`` and ``try_stream``)."""


class ActorDead(Exception):
    """The actor has stopped (or was killed) and will not handle this message."""


class AskTimeout(TimeoutError):
    """``ask`` got no reply within its timeout; a late reply is dropped."""
